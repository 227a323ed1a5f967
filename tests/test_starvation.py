"""The trainer-starvation detector on fixed sequences of checks (one every 10 s, window 60 s)."""

import pytest

from online_spec.config import ConfigError
from online_spec.starvation import DROPPING, STARVED, StarvationConfig, StarvationDetector


def run(det, checks):
    """checks: (t, steps, trainable, dropped) -> the kinds raised at each check."""
    return [[a.kind for a in det.update(t, s, tr, d, wall_time=1000.0 + t)] for t, s, tr, d in checks]


def test_no_verdict_before_a_full_window():
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=6))
    assert run(det, [(t, 0, True, 0) for t in range(0, 60, 10)]) == [[]] * 6
    assert run(det, [(60, 0, True, 0)]) == [[STARVED]]  # 0 steps in 60 s with traffic waiting


def test_starved_at_the_boundary_and_not_above_it():
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=6))
    # 6 steps a minute exactly: not starved (fewer than 6 is)
    assert run(det, [(t, t // 10, True, 0) for t in range(0, 70, 10)])[-1] == []
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=6))
    got = run(det, [(t, 5 * t // 60, True, 0) for t in range(0, 70, 10)])  # 5 a minute
    assert got[-1] == [STARVED]
    alert = det.update(70, 5, True, 0)
    assert alert == []  # raised once; not again within repeat_s


def test_no_traffic_to_train_on_is_not_starvation():
    det = StarvationDetector(StarvationConfig(window_s=60))
    checks = [(t, 0, t != 30, 0) for t in range(0, 130, 10)]  # idle at one check of every window up to t=90
    got = run(det, checks)
    assert got[:10] == [[]] * 10  # windows that hold the idle check at t=30
    assert got[10] == [STARVED]  # t=100: the window (40..100] saw traffic waiting at every check


def test_repeats_while_it_lasts_and_ends_when_steps_resume():
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=6, repeat_s=120))
    got = run(det, [(t, 0, True, 0) for t in range(0, 200, 10)])
    assert [t for t, g in zip(range(0, 200, 10), got) if g] == [60, 180]
    assert det.active == [STARVED]
    got = run(det, [(t, (t - 190) * 2, True, 0) for t in range(200, 270, 10)])  # 120 a minute from t=190
    assert det.active == [] and all(g == [] for g in got)


def test_a_restart_after_a_stop_starts_a_new_window():
    """A trainer stopped by a signal for 50 s (e.g. `bench e2e --interleave` pausing it): restarted
    on its continuation, the stopped time is no window of missed steps."""
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=6))
    assert run(det, [(t, t, True, 0) for t in range(0, 30, 10)]) == [[]] * 3  # 6 a minute and more
    det.restart()  # continued at t = 70 after 50 s stopped
    assert run(det, [(t, 20 + (t - 70), True, 0) for t in range(70, 130, 10)]) == [[]] * 6  # no verdict yet
    assert run(det, [(130, 80, True, 0)]) == [[]]  # a window of its own: 60 steps in 60 s
    # without the restart the same checks read the stop as starvation
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=6))
    got = run(det, [(0, 0, True, 0), (10, 10, True, 0), (20, 20, True, 0), (70, 20, True, 0), (80, 21, True, 0)])
    assert got[-1] == [STARVED]


def test_the_watch_restarts_its_window_on_sigcont():
    import os
    import signal

    from trainer.starvation_watch import StarvationWatch

    watch = StarvationWatch(StarvationConfig(window_s=60, min_steps_per_min=6))
    old = signal.getsignal(signal.SIGCONT)
    try:
        assert watch.follow_stops()
        assert watch.check(0.0, 0, True, None, None, 0) == []
        assert watch.check(10.0, 10, True, None, None, 0) == []
        os.kill(os.getpid(), signal.SIGCONT)  # as after a SIGSTOP: the handler counts it
        assert watch.continued == 1
        # 70 s after the first check with 10 steps: starved if the stop counted; a new window instead
        assert watch.check(70.0, 10, True, None, None, 0) == [] and watch.detector.active == []
        assert watch.check(131.0, 10, True, None, None, 0)[0].kind == STARVED  # a whole window of its own
    finally:
        signal.signal(signal.SIGCONT, old)


def test_dropped_records_raise_their_own_kind_with_the_figures():
    det = StarvationDetector(StarvationConfig(window_s=60, min_steps_per_min=0, min_dropped=10))
    run(det, [(t, t, True, 0) for t in range(0, 60, 10)])
    assert run(det, [(60, 60, True, 9)]) == [[]]
    alerts = det.update(70, 70, True, 25, head_version=4, wall_time=5.0)
    assert [a.kind for a in alerts] == [DROPPING]
    a = alerts[0]
    assert (a.before, a.after, a.head_version, a.time, a.level) == (10.0, 25.0, 4, 5.0, "warn")
    assert "capture" in a.text and "sample-fraction" in a.text


def test_config_errors_name_the_field():
    for kw, field in (({"window_s": 0}, "window_s"), ({"min_steps_per_min": -1}, "min_steps_per_min"),
                      ({"min_dropped": 0}, "min_dropped"), ({"repeat_s": 0}, "repeat_s")):
        with pytest.raises(ConfigError, match=field):
            StarvationConfig(**kw)


def _thread_niceness(pid: int) -> set[int]:
    """The niceness of every thread of `pid` (field 19 of /proc/PID/task/TID/stat)."""
    import os
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        out.add(int(stat[stat.rindex(")") + 2:].split()[16]))
    return out


def _may_lower_niceness() -> bool:
    import os
    import resource
    return os.geteuid() == 0 or 20 - resource.getrlimit(resource.RLIMIT_NICE)[0] <= 5


def test_a_starved_trainer_runs_at_the_lower_niceness_until_the_hold_after_it_ends():
    """A real process with threads (started at niceness 19, as the demo's trainer): while the watch
    says trainer_starved, every thread runs at --nice-starved; `hold_s` after the condition ended,
    back at --nice. Where this user may not lower a niceness, the share says so and changes nothing."""
    import subprocess
    import sys

    from trainer.starvation_watch import StarvationWatch
    from trainer.starved_share import StarvedShare

    code = ("import os, threading, time\nos.nice(19)\n"
            "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]\n"
            "print('up', flush=True)\ntime.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert _thread_niceness(child.pid) == {19}
        watch = StarvationWatch(StarvationConfig(window_s=60, min_steps_per_min=6))
        watch.share = share = StarvedShare(base=19, starved=5, hold_s=100.0, pid=child.pid)
        assert watch.check(10.0, 0, True, None, None, 0) == []
        assert watch.check(40.0, 1, True, None, None, 0) == [] and _thread_niceness(child.pid) == {19}
        assert watch.check(71.0, 1, True, None, None, 0)[0].kind == STARVED
        if not _may_lower_niceness():
            assert share.refused and not share.lowered and _thread_niceness(child.pid) == {19}
            return
        assert share.lowered and _thread_niceness(child.pid) == {5} and share.info()["niceness"] == 5
        assert watch.check(140.0, 40, True, None, None, 0) == [] and watch.detector.active == []  # steps again
        assert watch.check(210.0, 60, True, None, None, 0) == [] and _thread_niceness(child.pid) == {5}  # held
        watch.check(241.0, 70, True, None, None, 0)  # 101 s after the condition ended: back at 19
        assert not share.lowered and _thread_niceness(child.pid) == {19}
        assert watch.report()["starved_share"] == {"niceness": 19, "lowered": False, "times_lowered": 1,
                                                    "refused": None}
    finally:
        child.kill()
        child.wait()


def test_the_starved_share_refuses_bad_niceness():
    from trainer.starved_share import StarvedShare
    with pytest.raises(ValueError, match="niceness"):
        StarvedShare(base=19, starved=20)
    with pytest.raises(ValueError, match="hold_s"):
        StarvedShare(base=19, starved=5, hold_s=-1)


def test_the_watch_thread_sees_its_process_stopped_without_the_signal_handler():
    """A real child process whose watch runs beside a main thread held in one long call (as a torch
    step holds it: Python's SIGCONT handler cannot run there), stopped with SIGSTOP for 1 s and
    continued: the watch thread, woken late, counts the stop itself, before its next check."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = """
import time
import trainer.starvation_watch as sw
sw.STARVATION_CHECK_S = 0.05
watch = sw.StarvationWatch(None)
seen = []
stop = watch.beside(lambda: seen.append(watch.continued))
print('up', flush=True)
time.sleep(3.0)  # one long call in the main thread: no Python signal handler runs meanwhile
stop.set()
print(watch.continued, max(seen), flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert child.stdout.readline().strip() == "up"
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(child.pid, signal.SIGCONT)
        continued, seen = (int(x) for x in child.stdout.readline().split())
        assert continued == 1 and seen == 1  # counted once, and before a check read it
    finally:
        child.kill()
        child.wait()

"""A chain or tree round's capture: the engine hands the round over unbuilt (`CaptureRound`), the reader
builds the records, and they equal what a teacher-forced pass of the final sequences gives
(tiny fp32 target, a stand-in for SmolLM2 that runs the same engine code)."""

import pytest
import torch

from online_spec.capture import CaptureRecord, CaptureRound, RoundRow, adjacency_error
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.host_ring import HostRing
from serving.engine import Engine, EngineConfig
from serving.requests import Request
from tests.distill_helpers import tiny8
from trainer.data import capture_tokens


class _Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_round_builds_its_records_once_on_first_read_after_its_event():
    feats, final = torch.randn(2 * 4, 6), torch.randn(2 * 4, 2)  # [B * T, 3H], [B * T, H]: B = 2, T = 4
    drafts, probs = torch.tensor([[7, 8, 9], [4, 5, 6]]), torch.rand(2, 3)
    rows = [RoundRow("a", 10, 0, [1, 7, 8, 3], 2, 3, "chat"), RoundRow("b", 20, 1, [2, 9], 0, 3, "")]
    ev = _Event()
    rnd = CaptureRound(rows, feats, final, row_index=[0, 1, 2, 4], drafts=drafts, draft_probs=probs,
                       batch_size=2, draft_version=5, ready=ev, timestamp=1.0)
    assert rnd._records is None and ev.waited == 0 and len(rnd) == 2  # nothing built by the engine's calls
    a, b = list(rnd)
    assert ev.waited == 1 and rnd.records() is rnd.records() and ev.waited == 1
    assert a.tokens.tolist() == [1, 7, 8, 3] and a.first_pos == 10 and a.accept_len == 2 and a.tag == "chat"
    assert torch.equal(a.features, feats[:3]) and torch.equal(a.final_hidden, final[:3])
    assert torch.equal(b.features, feats[4:5]) and b.tokens.tolist() == [2, 9]
    assert a.draft_tokens.tolist() == [7, 8, 9] and torch.equal(b.draft_probs, probs[1])
    assert (a.batch_size, a.draft_version, a.timestamp) == (2, 5, 1.0)
    part = rnd[1:]  # what a full publisher queue keeps: still unbuilt, the same rows
    assert isinstance(part, CaptureRound) and part._records is None and part[0].request_id == "b"


def test_a_slice_of_a_round_builds_the_rows_of_its_own_records():
    """Any slice, not only a prefix: each record keeps its own rows, with a row index (CPU and CUDA
    rounds) or without one (rows in record order)."""
    feats, final = torch.randn(8, 6), torch.randn(8, 2)
    drafts, probs = torch.tensor([[7, 8, 9], [4, 5, 6], [1, 2, 3]]), torch.rand(3, 3)
    rows = [RoundRow("a", 10, 0, [1, 7, 8, 3], 2, 3, ""), RoundRow("b", 20, 1, [2, 9], 0, 3, ""),
            RoundRow("c", 5, 2, [4, 6], 0, 3, "")]
    rnd = CaptureRound(rows, feats, final, row_index=[0, 1, 2, 4, 6], drafts=drafts, draft_probs=probs, batch_size=3)
    want = {"a": feats[0:3], "b": feats[4:5], "c": feats[6:7]}
    for part in (rnd[1:], rnd[::2], rnd[:1], rnd[2:], rnd[::-1]):
        assert part._records is None
        for rec in part:
            assert torch.equal(rec.features, want[rec.request_id]) and rec.num_rows == len(want[rec.request_id])
    assert [r.request_id for r in rnd[::2]] == ["a", "c"]
    ordered = torch.randn(5, 6)  # no index: a's rows 0-2, b's row 3, c's row 4
    rnd = CaptureRound(rows, ordered, torch.randn(5, 2), drafts=drafts, draft_probs=probs, batch_size=3)
    b, c = rnd[1:]
    assert torch.equal(b.features, ordered[3:4]) and torch.equal(c.features, ordered[4:5])
    assert torch.equal(rnd[::2][1].features, ordered[4:5])


def test_host_ring_reuses_a_slot_only_once_nothing_holds_it():
    """`HostRing`'s slot logic on this CPU (pinned memory and the CUDA event need a GPU: here the
    slots are pageable and there is no event; the CUDA cases of the engine test below run the
    real thing): a slot a round or a slice of it still holds is never written, a free one is
    reused, a free one too small is made anew, and with every slot held a round gets fresh memory."""
    ring = HostRing(pin=False, max_slots=2)
    x, y = torch.randn(2, 3, 12), torch.randn(2, 3, 4)
    f, h, ev = ring.stage(x, y)
    assert ev is None and torch.equal(f, x.reshape(6, 12)) and torch.equal(h, y.reshape(6, 4))
    held = CaptureRound([RoundRow("a", 0, 0, [1, 2], 0, 0, "")], f, h, row_index=[0])
    del f, h
    f, h, _ = ring.stage(x + 1, y + 1)  # slot 0 is held: slot 1
    assert ring.allocated == 2 and torch.equal(held.features, x.reshape(6, 12))
    part = held[:1]
    del held
    g, _, _ = ring.stage(x + 2, y + 2)  # slot 0 held by the slice, slot 1 by f: fresh memory
    assert ring.unpooled == 1 and torch.equal(part.features, x.reshape(6, 12))
    assert torch.equal(g, (x + 2).reshape(6, 12))
    del part, g
    f2, _, _ = ring.stage(x + 3, y + 3)  # slot 0 is free again: reused, no new slot
    assert ring.allocated == 2 and torch.equal(f2, (x + 3).reshape(6, 12))
    assert torch.equal(f, (x + 1).reshape(6, 12))  # slot 1 untouched while f holds it
    del f, h
    big = torch.randn(4, 10, 12), torch.randn(4, 10, 4)  # 40 rows: more than a slot of 32 holds
    fb, hb, _ = ring.stage(*big)
    assert ring.allocated == 3 and fb.shape == (40, 12) and torch.equal(hb, big[1].reshape(40, 4))
    with pytest.raises(ValueError, match="max_slots"):
        HostRing(pin=False, max_slots=0)


class _Sink:
    """Keeps each round unbuilt (`hold`), or builds its records at once and keeps only them, as
    the publisher's sender does (the round, and with it its host slot on CUDA, then goes)."""

    def __init__(self, hold: bool = True):
        self.rounds, self.prefills, self.hold = [], [], hold

    def should_capture(self, request_id):
        return request_id != "skip"

    def submit(self, records):
        if isinstance(records, CaptureRound):
            self.rounds.append(records if self.hold else list(records))
        else:
            self.prefills.append(records)

    def end_request(self, request_id):
        pass


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tree, sampled, hold, device", [
    (False, False, True, "cpu"), (True, False, True, "cpu"), (True, True, True, "cpu"),
    pytest.param(False, False, True, "cuda", marks=CUDA), pytest.param(False, False, False, "cuda", marks=CUDA),
    pytest.param(False, True, False, "cuda", marks=CUDA), pytest.param(True, True, False, "cuda", marks=CUDA)])
def test_engine_rounds_capture_what_teacher_forcing_gives(tree, sampled, hold, device):
    """Chain and tree rounds (a greedy batch's tree on the device path, a batch with a sampling
    request on the host path) hand over `CaptureRound`s whose rows are the teacher-forced ones.
    On CUDA through the engine's pinned host slots (`HostRing`): every slot held by the sink
    (`hold`: the ring fills, then rounds get fresh memory), or each round read at once and let go
    (its slot is reused, and no reuse overwrote rows a round still had to read)."""
    torch.manual_seed(0)
    target = tiny8().to(device)
    shape = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if tree else {}
    eng = Engine(target, new_head(target, draft_vocab_size=256, seed=3),
                 EngineConfig(max_batch=4, max_len=256, num_steps=3, **shape), publisher=(sink := _Sink(hold)))
    if device == "cuda":
        eng._host_ring = HostRing(pin=True, max_slots=4)  # a small ring: the held rounds fill it
    prompts = {"r0": [5, 9, 33, 7], "r1": [1, 2, 3, 4, 5, 6], "skip": [100, 200, 300]}
    for rid, p in prompts.items():
        params = SamplingParams(max_tokens=20, ignore_eos=True, **({"temperature": 0.8, "seed": 7}
                                                                    if sampled and rid == "r1" else {}))
        eng.add_request(Request(p, params, request_id=rid))
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    topks = set()
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
        if eng.last_round is not None and eng.last_round.num_steps:
            topks.add(eng.last_round.topk)
    assert topks == ({2} if tree else {1})
    assert sink.rounds and all(not hold or r._records is None for r in sink.rounds)  # the engine built none
    records = [rec for rnd in sink.rounds for rec in rnd]
    ring = eng.__dict__.get("_host_ring")
    if device == "cuda":
        if hold:  # no slot ever freed: four slots, then fresh memory a round
            assert ring.allocated == 4 and ring.unpooled == len(sink.rounds) - 4 > 0
        else:  # each round's slot free again before the next round: one slot, reused
            assert ring.allocated == 1 and ring.unpooled == 0
    else:
        assert ring is None  # on a CPU the verify's own tensors go over
    assert {r.request_id for r in records} == {"r0", "r1"}  # an unsampled request sends nothing
    for rid in ("r0", "r1"):
        seq = prompts[rid] + outs[rid]
        ref = capture_tokens(target, [seq], [rid])[0]  # teacher-forced rows of the whole sequence
        ref.features, ref.final_hidden = ref.features.cpu(), ref.final_hidden.cpu()
        pre = [r for batch in sink.prefills for r in batch if r.request_id == rid]
        mine = sorted((r for r in records if r.request_id == rid), key=lambda r: r.first_pos)
        assert len(pre) == 1 and pre[0].is_prefill and pre[0].first_pos == 0
        assert mine[0].first_pos == len(prompts[rid])  # decode rounds go on from the prefill's rows
        mine = pre + mine
        for prev, rec in zip(mine, mine[1:]):
            assert adjacency_error(prev, rec) is None
        for rec in mine:
            lo, n = rec.first_pos, rec.num_rows
            assert isinstance(rec, CaptureRecord) and rec.tokens.tolist() == seq[lo:lo + n + 1]
            torch.testing.assert_close(rec.features.float().cpu(), ref.features[lo:lo + n].float(),
                                       atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(rec.final_hidden.float().cpu(), ref.final_hidden[lo:lo + n].float(),
                                       atol=2e-2, rtol=2e-2)
            if not rec.is_prefill:
                assert rec.num_rows == rec.accept_len + 1 and len(rec.draft_tokens) == rec.num_steps
                assert rec.draft_tokens[:rec.accept_len].tolist() == rec.tokens[1:rec.accept_len + 1].tolist()
        assert mine[-1].first_pos + mine[-1].num_rows >= len(seq) - 1 - 3  # the last round's rows reach the end

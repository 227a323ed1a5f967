"""ShareGPT split by topic: its chat conversations and its code conversations, on the real data."""

import pytest

from online_spec.data import is_code_conversation, sharegpt_conversations


def _conv(user: str, reply: str = "Sure.") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


@pytest.mark.parametrize("user, reply, code", [
    ("How do I reverse a list in Python?", "Use reversed().", True),
    ("Why does this fail?\n\nfor (i = 0; i < n; i++) {\n  x[i] = 0;\n}", "Because...", True),
    ("Explain what this does", "```js\nconsole.log(1)\n```", True),  # code in the first reply only
    ("Write a SQL query for the top customers", "SELECT ...", True),
    ("Give me ten names for a bakery", "1. Crumbs", False),
    ("Do astronauts get sick in space?", "Yes, sometimes.", False),
    ("Summarise the history of the printing press", "Gutenberg...", False),
])
def test_code_rule(user, reply, code):
    assert is_code_conversation(_conv(user, reply)) is code


def test_topics_partition_sharegpt():
    for split in ("train", "heldout"):
        every = {c[0]["content"] for c in sharegpt_conversations(split=split)}
        chat = sharegpt_conversations(split=split, topic="chat")
        code = sharegpt_conversations(split=split, topic="code")
        assert chat and code
        assert not any(is_code_conversation(c) for c in chat)
        assert all(is_code_conversation(c) for c in code)
        assert len(chat) + len(code) == len(sharegpt_conversations(split=split))
        assert {c[0]["content"] for c in chat} | {c[0]["content"] for c in code} == every
    # about a third of ShareGPT is about programming (6,469 chat / 3,530 code of the train split)
    assert 0.25 < len(sharegpt_conversations(topic="code")) / len(sharegpt_conversations()) < 0.45


def test_unknown_topic_is_an_error():
    with pytest.raises(ValueError, match="topic"):
        sharegpt_conversations(limit=1, topic="poetry")

"""``ferrox_kv.serve.text`` without a model: the incremental detokenizer and
the stop strings over a vocabulary whose tokens split multi-byte UTF-8
characters. The chunks a stream sends join to exactly the whole text, the
text never holds a stop, and it is the whole decode cut where the first
stop to end starts."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_kv.serve.text import Detokenizer, TextStream

# pieces of "日本語", "é", "€", an emoji, ASCII, and bytes no character uses
ALPHABET = "日本語é€😀ab "
VOCAB = sorted({b for ch in ALPHABET for b in (
    ch.encode(), ch.encode()[:1], ch.encode()[1:], ch.encode()[:2], ch.encode()[2:])
    if b} | {"日本".encode()[2:4], "本a".encode(), b"\xff", b"\x80"})


def decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", "replace")


class CountingDecode:
    """``decode`` that counts the ids it is given."""

    def __init__(self):
        self.ids = 0

    def __call__(self, ids):
        self.ids += len(ids)
        return decode(ids)


def tok(piece):
    return VOCAB.index(piece)


def expected(full, stops):
    """The whole text, cut where the first stop to end starts (the longest
    of those that end there)."""
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return full if best is None else full[:best[1]]


def run(ids, stops):
    """(the chunks sent, the whole text, whether a stop ended it)."""
    t = TextStream(decode, stops)
    sent = []
    for i in ids:
        chunk, stopped = t.push(i)
        sent.append(chunk)
        if stopped:
            return sent, t.text, True
    chunk, stopped = t.finish()
    sent.append(chunk)
    return sent, t.text, stopped


ids_st = st.lists(st.integers(0, len(VOCAB) - 1), max_size=40)
stops_st = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4)


@settings(max_examples=400, deadline=None)
@given(ids_st, stops_st)
def test_streamed_text_equals_the_whole_text_and_never_holds_a_stop(ids, stops):
    sent, text, _ = run(ids, stops)
    assert "".join(sent) == text
    for s in stops:
        assert s not in text
        assert all(s not in c for c in sent)
    assert text == expected(decode(ids), stops)


@settings(max_examples=200, deadline=None)
@given(ids_st)
def test_the_detokenizer_releases_the_whole_decode_and_no_partial_character(ids):
    d = Detokenizer(decode)
    parts = [d.push(i) for i in ids]
    tail = d.flush()
    assert "".join(parts) + tail == decode(ids) == d.text
    assert all(not p.endswith("\ufffd") or "\ufffd" in decode(ids) for p in parts)


def test_a_token_that_completes_a_stop_start_leaks_nothing_of_it():
    """The stop is "日本"; one token completes 日 and starts 本 (its text
    then ends in U+FFFD): nothing of 日 is sent before the stop ends the text."""
    ni, hon = "日".encode(), "本".encode()
    pieces = [b"a", ni[:2], ni[2:] + hon[:1], hon[1:], b"b"]
    global VOCAB
    saved, VOCAB = VOCAB, pieces
    try:
        sent, text, stopped = run(range(len(pieces)), ["日本"])
    finally:
        VOCAB = saved
    assert stopped and text == "a" and "".join(sent) == "a"


def test_the_text_is_released_once_its_characters_are_complete():
    d = Detokenizer(decode)
    ni = "日".encode()
    assert d.push(tok(b"a")) == "a"
    assert d.push(tok(ni[:1])) == ""            # 日 is not complete yet
    assert d.push(tok(ni[1:])) == "日"
    assert d.push(tok(ni[:2])) == ""
    assert d.flush() == "\ufffd"                # what the whole decode gives for the rest


def test_per_token_decoding_is_bounded_by_the_window_not_the_output():
    """2,000 tokens: the ids decoded per token stay a few, not the output."""
    count = CountingDecode()
    d = Detokenizer(count)
    ids = [tok(b"a"), tok("日".encode()), tok(b" ")] * 700
    for i in ids:
        d.push(i)
    assert d.text == decode(ids)
    assert count.ids <= 4 * len(ids)


def test_push_after_a_stop_is_refused():
    t = TextStream(decode, ["a"])
    assert t.push(tok(b"a")) == ("", True)
    with pytest.raises(RuntimeError, match="stop"):
        t.push(tok(b"b"))
    assert t.finish() == ("", True)

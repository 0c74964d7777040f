"""Cutting a streamed answer for the voice: an early first piece, then sentences, a cap on
run-ons, and no cuts inside numbers, abbreviations or list numbers."""

import re

import pytest

from workers.speech.clause_splitter import ClauseSplitter, split_clauses


def stream(splitter: ClauseSplitter, text: str) -> list[tuple[int, str]]:
    """Feed `text` in LLM-sized deltas (a leading space and up to three characters); each
    piece with the number of deltas fed when it came, flush's pieces last."""
    deltas = re.findall(r"\s*\S{1,3}|\s+", text)
    pieces = []
    for index, delta in enumerate(deltas, start=1):
        pieces += [(index, piece) for piece in splitter.feed(delta)]
    return pieces + [(len(deltas) + 1, piece) for piece in splitter.flush()]


def squeeze(text: str) -> str:
    return "".join(text.split())


def test_first_piece_comes_at_first_clause_mark_then_whole_sentences():
    text = ("Well, I think the answer is yes, because the data says so. "
            "Then we check it again, twice. Finally we are done!")
    pieces = stream(ClauseSplitter(), text)
    assert [piece for _, piece in pieces] == [
        "Well, I think the answer is yes,",
        "because the data says so.",
        "Then we check it again, twice.",
        "Finally we are done!",
    ]
    # The first piece is out as soon as the delta after "yes," arrives, long before the end.
    delta_count = len(re.findall(r"\s*\S{1,3}|\s+", text))
    assert pieces[0][0] <= 12 < delta_count


def test_first_piece_without_punctuation_comes_after_eight_words():
    splitter = ClauseSplitter()
    text = "one two three four five six seven eight nine ten eleven twelve"
    pieces = stream(splitter, text)
    assert pieces[0][1] == "one two three four five six seven eight"
    assert [piece for _, piece in pieces[1:]] == ["nine ten eleven twelve"]


def test_short_opening_sentence_is_its_own_first_piece():
    pieces = [piece for _, piece in stream(ClauseSplitter(), "Hi! Sure, I can help with that today.")]
    assert pieces == ["Hi!", "Sure, I can help with that today."]


def test_pieces_put_together_are_the_whole_answer():
    text = ("Here is a longer answer, with clauses; colons: and dashes — of all sorts. It costs $3.14 "
            "(e.g. at Dr. Lee's shop on St. Mark's Place)... Really? Yes!\n\n1. First item\n2. Second item\n"
            + "and then a very long run on sentence that never ends " * 8 + "until now.")
    pieces = [piece for _, piece in stream(ClauseSplitter(), text)]
    assert len(pieces) >= 8
    assert all(piece == piece.strip() and piece for piece in pieces)
    assert squeeze("".join(pieces)) == squeeze(text)


def test_no_cut_inside_numbers_abbreviations_or_list_numbers():
    splitter = ClauseSplitter()
    assert splitter.feed("Okay. ") == ["Okay."]  # past the first piece: only sentences cut now
    text = "Pi is 3.14 and e.g. Dr. Smith or Mr. J. Doe agree.\n1. first item\n"
    pieces = [piece for _, piece in stream(splitter, text)]
    assert pieces == ["Pi is 3.14 and e.g. Dr. Smith or Mr. J. Doe agree.", "1. first item"]


def test_a_stop_at_the_end_of_a_delta_waits_for_what_follows():
    splitter = ClauseSplitter()
    assert splitter.feed("It costs about 3.") == []
    assert splitter.feed("50 dollars") == []
    assert splitter.feed(".") == []
    assert splitter.feed(" And") == ["It costs about 3.50 dollars."]


def test_run_on_sentence_is_cut_at_word_boundaries_within_the_cap():
    words = [f"word{number}" for number in range(60)]
    pieces = [piece for _, piece in stream(ClauseSplitter(max_chars=50), " ".join(words))]
    assert len(pieces) >= 8
    assert all(len(piece) <= 50 for piece in pieces)
    assert " ".join(pieces).split() == words  # every cut fell between two words


def test_cap_prefers_the_last_clause_mark_to_a_word_boundary():
    splitter = ClauseSplitter(max_chars=60)
    assert splitter.feed("Fine. ") == ["Fine."]
    text = "alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu nu xi"
    pieces = [piece for _, piece in stream(splitter, text)]
    assert pieces == ["alpha beta gamma,", "delta epsilon zeta eta theta iota kappa lambda mu nu xi"]


def test_one_endless_word_is_cut_at_the_cap():
    pieces = ClauseSplitter(max_chars=20).feed("x" * 45)
    assert pieces == ["x" * 20, "x" * 20]


def test_flush_returns_the_rest_and_starts_a_new_answer():
    splitter = ClauseSplitter()
    assert splitter.feed("Hello there") == []
    assert splitter.flush() == ["Hello there"]
    assert splitter.flush() == []
    # A new answer gets an early first piece again.
    assert splitter.feed("Well now, you see, it is ") == ["Well now, you see,"]


def test_whitespace_is_never_a_piece():
    splitter = ClauseSplitter(max_chars=10)
    assert splitter.feed("\n\n   \n\t" + " " * 30) == []
    assert splitter.flush() == []


def test_split_clauses_names_each_clause_mark():
    text = 'Hi, there; you: "yes." Done?! Wait... now — go\nEnd'
    assert split_clauses(text) == [
        ("Hi,", ","), (" there;", ";"), (" you:", ":"), (' "yes."', "."), (" Done?!", "?"),
        (" Wait...", ","), (" now —", ","), (" go\n", "\n"), ("End", ""),
    ]


def test_thresholds_are_checked():
    with pytest.raises(ValueError):
        ClauseSplitter(first_min_words=5, first_max_words=4)
    with pytest.raises(ValueError):
        ClauseSplitter(max_chars=0)

"""The token floor (engine/token_floor.py) never exceeds the tokens a text really takes, so a
prompt it refuses is surely too long; and it is close enough to refuse long prose cheaply."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.token_floor import TokenFloor
from tests.tiny_models import CORPUS, SPECIAL_TOKENS, build_tokenizer

# Long runs of one character, as real vocabularies hold ("=" * 64, a newline and spaces).
LONG_RUNS = ["=" * 64, "-" * 48, "\n" + " " * 40, "#" * 80, " " * 32]


def byte_level_tokenizer(corpus: list[str], vocab_size: int, normalizer=None) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")


@pytest.fixture(scope="module", params=["tiny", "long-runs", "nfc"])
def tokenizer(request):
    if request.param == "tiny":
        return build_tokenizer()
    if request.param == "long-runs":
        return byte_level_tokenizer(CORPUS + LONG_RUNS * 30, 1024)
    return byte_level_tokenizer(CORPUS, 512, normalizers.NFC())


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


PIECES = st.sampled_from(["e\u0301", "\u1100\u1161\u11a8", ">\u0338", "<|im_end|>", "<|im_start|>", "\U000f0000",
                          " ", "\n", "=" * 70, "#" * 81, "caf\u00e9", "\U0001F600", "the", "\u65e5\u672c"])
TEXTS = st.lists(st.one_of(st.text(max_size=40), PIECES), max_size=60).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_the_floor_never_exceeds_the_token_count(tokenizer, text):
    assert TokenFloor.of(tokenizer).tokens(text) <= count(tokenizer, text)


@pytest.mark.parametrize("text", ["=" * 10_000, "#" * 8_100, "\n" + " " * 4000, "a" * 5000, "", "x",
                                  "e\u0301" * 300, "<|im_start|>user\nhi<|im_end|>\n" * 40],
                         ids=["equals", "hashes", "indent", "letters", "empty", "one", "accents", "turns"])
def test_the_floor_never_exceeds_the_token_count_of_runs(tokenizer, text):
    assert TokenFloor.of(tokenizer).tokens(text) <= count(tokenizer, text)


def test_the_floor_of_prose_is_well_above_bytes_over_the_longest_token():
    tokenizer = byte_level_tokenizer(CORPUS + LONG_RUNS * 30, 1024)
    floor = TokenFloor.of(tokenizer)
    prose = " ".join(CORPUS) * 20
    assert floor.longest >= 64
    # Long tokens are runs of a few characters; letters only ever sit in short ones.
    assert floor.tokens(prose) > 4 * len(prose.encode()) / floor.longest
    assert floor.tokens(prose) <= count(tokenizer, prose)


def test_no_floor_where_it_would_not_hold():
    swallowing = build_tokenizer()
    swallowing.add_tokens([AddedToken("<sep>", rstrip=True, special=True)], special_tokens=True)
    assert TokenFloor.of(swallowing) is None  # "<sep>   " is one token, however many spaces
    word_pieces = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert TokenFloor.of(PreTrainedTokenizerFast(tokenizer_object=word_pieces)) is None
    lowercased = byte_level_tokenizer(CORPUS, 512, normalizers.Lowercase())
    assert TokenFloor.of(lowercased) is None

"""Grammar-constrained decoding in the engine (offline LLM, tiny random models): answers
match their schema, regex or choices for greedy and sampled decoding, in batches and after
preemption; a grammar that allows every token it meets changes nothing (greedy parity with
transformers); a spec that cannot compile fails its request only."""

import json
import threading

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammars import GrammarCompiler, GrammarError
from engine.sampling_params import StructuredOutput
from tests.reference import load_reference_model
from tests.tiny_models import build_tokenizer

CHAT = [{"role": "user", "content": "hello"}]
# Bounded strings and numbers: a random model would otherwise write one string forever.
# (No maxLength: xgrammar 0.2.8 lets control characters into maxLength strings.)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "name", "tags"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=256)


def constrained(kind: str, spec: str = "", **params) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutput(kind, spec), **{"max_tokens": 80, **params})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate_in_a_batch(llm, temperature):
    params = [constrained("json_schema", json.dumps(SCHEMA), temperature=temperature, seed=seed)
              for seed in range(6)]
    for out in llm.generate([llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)] * 6, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_and_choice(llm):
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    outs = llm.generate([prompt] * 3, [
        constrained("json_object", temperature=0.7, seed=3, max_tokens=200),
        constrained("regex", r"[0-9]{3}-[0-9]{4}", temperature=1.0, seed=1),
        constrained("choice", json.dumps(["yes", "no", "maybe so"]), temperature=1.0, seed=2)])
    if outs[0].finish_reason == "stop":  # JSON of unbounded size may run out of tokens
        json.loads(outs[0].text)
    else:
        assert outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "stop" and len(outs[1].text) == 8 and outs[1].text[3] == "-"
    assert outs[1].text.replace("-", "").isdigit()
    assert outs[2].text in ("yes", "no", "maybe so")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constraints_hold_under_preemption(tiny_llama, async_scheduling):
    # 31 usable blocks of 4 tokens for 6 answers of ~40 tokens each: requests are preempted
    # and recomputed; each matcher is rebuilt from the tokens replayed after it.
    llm = LLM(str(tiny_llama), num_kv_blocks=32, block_size=4, max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    outs = llm.generate([prompt] * 6, [constrained("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=s)
                                       for s in range(6)])
    assert llm.engine.stats().num_preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("kind,spec", [("regex", r"[\s\S]*"), ("json_schema", json.dumps(SCHEMA))],
                         ids=["any-text", "schema"])
def test_greedy_parity_with_transformers_under_the_same_grammar(llm, tiny_llama, kind, spec):
    # The reference: transformers' generate with xgrammar's own logits processor for the same
    # grammar. With any text allowed, this is greedy parity with the mask machinery on.
    from xgrammar.contrib.hf import LogitsProcessor

    compiler = GrammarCompiler(lambda: llm.tokenizer, len(llm.tokenizer))
    compiled = compiler.compile(StructuredOutput(kind, spec))
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    model = load_reference_model(tiny_llama)
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              logits_processor=[LogitsProcessor(compiled)])[0, len(prompt):].tolist()
    out = llm.generate([prompt], constrained(kind, spec, temperature=0, max_tokens=40, ignore_eos=True))[0]
    eos = llm.tokenizer.eos_token_id
    expected = expected[:expected.index(eos) + 1] if eos in expected else expected
    assert out.token_ids[:len(expected)] == expected
    assert len(expected) > 5


def test_a_spec_that_cannot_compile_fails_only_its_request(llm):
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    bad, good = llm.generate([prompt, prompt], [constrained("grammar", "root ::= ("),
                                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    assert bad.finish_reason == "error" and "grammar" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 8


def test_compile_errors_say_what_is_wrong(llm):
    compiler = GrammarCompiler(lambda: llm.tokenizer, len(llm.tokenizer))
    for spec, words in [(StructuredOutput("regex", "a(b"), "parenthesis"),
                        (StructuredOutput("json_schema", '{"$ref": "#/nope"}'), "nope"),
                        (StructuredOutput("grammar", "root ::= ("), "EBNF")]:
        with pytest.raises(GrammarError, match=words):
            compiler.compile(spec)


@pytest.mark.parametrize("kind,spec", [
    ("grammar", "root ::= root"),
    ("grammar", 'root ::= "a" root'),
    ("grammar", 'root ::= "a" x\nx ::= "b" y\ny ::= x "c"'),
    ("grammar", "root ::= x{1,3}\nx ::= x"),
    ("json_schema", '{"$ref": "#"}'),
    ("json_schema", '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'),
    ("json_schema", json.dumps({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}})),
    ("regex", "[^\\x00-\\U0010FFFF]"),
])
def test_a_grammar_that_can_match_no_text_is_a_grammar_error(kind, spec):
    compiler = GrammarCompiler(lambda: build_tokenizer(), 384)
    with pytest.raises(GrammarError, match="can match no text"):
        compiler.compile(StructuredOutput(kind, spec))


@pytest.mark.parametrize("kind,spec", [
    ("grammar", 'root ::= ""'),  # only the empty answer: the model may only stop
    ("grammar", 'root ::= "a" x\nx ::= "b" x | ""'),
    ("grammar", "root ::= x{0,3}\nx ::= x"),
    ("grammar", "\n".join(["root ::= r0"] + [f"r{i} ::= [a-z] r{i + 1}" for i in range(200)] + ['r200 ::= "x"'])),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}})),
    ("json_schema", json.dumps({"type": "object", "required": ["a"],
                                "properties": {"a": {"type": "array", "items": {"$ref": "#"}}}})),
    ("regex", "[^a-z]+"),
])
def test_a_recursive_grammar_that_can_end_compiles(kind, spec):
    GrammarCompiler(lambda: build_tokenizer(), 384).compile(StructuredOutput(kind, spec))


def test_the_decoder_shares_a_compile_within_a_cache_salt_and_compiles_anew_for_another(monkeypatch):
    # Two tenants (cache salts) asking for one schema: the second must not get the first's
    # compile (or xgrammar's cached copy of it), whose speed would tell it the schema was used.
    compiler = GrammarCompiler(lambda: build_tokenizer(), 384)
    compiled = []
    real_compile = compiler._xgrammar_compiler().compile_grammar
    monkeypatch.setattr(compiler, "_compiler", type("Counting", (), {
        "compile_grammar": lambda self, grammar: compiled.append(1) or real_compile(grammar)})())
    spec = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    first = compiler.submit(spec, "tenant-a")
    assert compiler.submit(spec, "tenant-a") is first
    other = compiler.submit(spec, "tenant-b")
    assert other is not first
    first.result(), other.result()
    assert len(compiled) == 2


def test_the_decoders_remembered_compiles_are_bounded_by_bytes():
    compiler = GrammarCompiler(lambda: build_tokenizer(), 384, cache_bytes=1)
    futures = [compiler.submit(StructuredOutput("regex", f"[a-z]{{{n}}}")) for n in range(1, 6)]
    for future in futures:
        future.result()
    compiler.submit(StructuredOutput("regex", "x"))
    assert len(compiler._recent) <= 2  # the newest, and none of the older ones' bytes


def test_a_slow_grammar_delays_only_its_own_request(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=256)
    engine = llm.engine
    grammars = engine.core.executor.grammars
    # The compile is held until the free request is done: however slow a grammar is, the
    # others' steps go on (the compile has its own thread; the request waits in the queue).
    release = threading.Event()
    real_compile = grammars.compile
    grammars.compile = lambda spec: (release.wait(30), real_compile(spec))[1]
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    slow = engine.add_request(prompt, constrained("regex", "[a-z]{4}", temperature=0, max_tokens=4))
    free = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = {slow: 0, free: 0}
    outcome = {}
    while free not in outcome:
        for out in engine.step():
            tokens[out.request_id] += len(out.new_token_ids)
            if out.finished:
                outcome[out.request_id] = out
    assert tokens[free] == 12 and tokens[slow] == 0
    release.set()
    while slow not in outcome:
        for out in engine.step():
            if out.finished:
                outcome[out.request_id] = out
    assert outcome[slow].error is None and len(outcome[slow].text) == 4 and outcome[slow].text.isalpha()


def test_a_grammar_that_does_not_compile_in_time_fails_its_request(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=256, grammar_timeout_s=0.2)
    grammars = llm.engine.core.executor.grammars
    release = threading.Event()
    real_compile = grammars.compile
    grammars.compile = lambda spec: (release.wait(30), real_compile(spec))[1]
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    try:
        slow, free = llm.generate([prompt, prompt], [constrained("regex", "[a-z]+"),
                                                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    finally:
        release.set()
    assert slow.finish_reason == "error" and "grammar_timeout_s" in slow.error
    assert free.finish_reason == "length"


def test_ignore_eos_after_a_complete_answer_adds_only_stop_tokens(llm):
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    out = llm.generate([prompt], constrained("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=4,
                                             ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 80
    jsonschema.validate(json.loads(out.text), SCHEMA)
    eos = llm.tokenizer.eos_token_id
    first_eos = out.token_ids.index(eos)
    assert set(out.token_ids[first_eos:]) == {eos}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_token_the_grammar_rejects_fails_only_its_request(tiny_llama, monkeypatch, async_scheduling):
    """A rejected token (here: the mask is not applied, as if the logits were all NaN) fails
    its request; with asynchronous scheduling its next step was already scheduled, and the
    runner must still run it and everyone else's (it once crashed the decoder)."""
    from workers.structured_decoding import StructuredDecoding

    monkeypatch.setattr(StructuredDecoding, "apply", staticmethod(lambda logits, masks: None))
    llm = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=async_scheduling)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [5, 6, 7], [8, 9]],
                        [constrained("regex", "a{40}", temperature=0), free, free])
    assert outs[0].finish_reason == "error" and "grammar" in outs[0].error
    assert [len(o.token_ids) for o in outs[1:]] == [12, 12]
    assert llm.generate([[5, 6, 7]], free)[0].token_ids == outs[1].token_ids


@pytest.mark.parametrize("params", [dict(temperature=1e-45), dict(temperature=1.0, repetition_penalty=1e38, seed=1)],
                         ids=["tiny-temperature", "huge-penalty"])
def test_extreme_sampling_values_still_follow_the_grammar(llm, params):
    """Both once sent every logit to inf, -inf or NaN, so argmax picked token 0 whatever the
    grammar allowed."""
    out = llm.generate([[5, 6, 7]], constrained("regex", "[a-z]{12}", **params))[0]
    assert out.finish_reason == "stop" and len(out.text) == 12 and out.text.isalpha(), (out.text, out.error)

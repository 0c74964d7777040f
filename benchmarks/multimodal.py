"""Multimodal benchmark: what the encoder cache, the multimodal prefix cache and prefilling
beside encoding buy, what the caches cost when they never hit, and how fast the frontend
preprocesses images. One run prints one table; every ratio is against a baseline measured
in the same run.

    python benchmarks/multimodal.py            # the full run (about 4 minutes on 2 quiet cores)
    python benchmarks/multimodal.py --quick    # tiny sizes, to check that the script runs
    python benchmarks/multimodal.py --skip c e # leave measurements out

The model is a random-weight Qwen2-VL (the real architecture, transformers' classes) whose
vision tower and language model keep realistic proportions: per image embedding the tower
costs about a third of the language model's FLOPs per token, as in Qwen2-VL-7B (a 675M
tower run over 4 patches per embedding beside a 7B language model); on this CPU the narrow
tower runs less efficiently, so in time it is about half. Built once into the cache folder
($ANTIPHON_CACHE or ~/.cache/antiphon, under models/), with SmolLM2's tokenizer (the
embedded default model's) plus Qwen's vision tokens and an image-aware ChatML template.

(a) 100 requests over 30 distinct images placed after different texts: encoder runs and
    total time, global encoder cache on (its default size) vs off (offline: the server has
    no switch for it).
(b) TTFT of system text + image + question with everything but the question cached, vs the
    same shape cold (server), next to the ideal ratio (all prompt tokens / uncomputed ones).
(c) TTFT of a long text before an image while the encoder is busy with other images: the
    engine as is (the decoder prefills the text while the image is encoded) vs an estimate
    of waiting for the embeddings first (no switch exists for that; see measure_overlap).
(d) Encoder + prefix caches at a 0% hit rate: throughput with both on vs both off.
(e) Frontend preprocessing (data URL -> decoded image -> pixels + hash), 1 and 2 threads,
    and 2 processes for comparison.

Server measurements pin the encoder process to core 0 and the decoder process to core 1
(every thread of each, one OpenMP thread each), as an encoder and a decoder would each own
their device; the frontend and this client are not pinned.

One file on purpose (~790 lines): its measurements (a)-(e) share one model build and one
table, and each is read beside its baseline.
"""

from __future__ import annotations

import argparse
import base64
import gc
import http.client
import io
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

WORDS = ("the a of and to in harbour light window morning river stone garden market street bridge "
         "quiet old new small bright dark green blue red yellow under over near behind across after "
         "before people walk watch carry open close build paint write read travel wait remember "
         "notice every some many few often never always slowly quickly carefully together alone "
         "city village mountain forest field road station tower clock bell boat train letter").split()


@dataclass(frozen=True)
class Scale:
    """Model and workload sizes; FULL is the README run, QUICK checks that the script runs."""

    # Language model (Qwen2 decoder) and vision tower (Qwen2-VL ViT + 2x2 patch merger).
    lm_hidden: int = 768
    lm_layers: int = 8
    lm_intermediate: int = 2048
    lm_heads: int = 12
    lm_kv_heads: int = 2
    tower_dim: int = 256
    tower_depth: int = 4
    tower_heads: int = 4
    # The image processor keeps an image under this many pixels (256 embeddings of 28x28).
    max_pixels: int = 256 * 28 * 28
    # Request images: 448x336 -> 32x24 patches -> 192 embeddings.
    image_size: tuple[int, int] = (448, 336)
    kv_blocks: int = 2048
    # (a)
    a_requests: int = 100
    a_images: int = 30
    a_concurrency: int = 8
    a_words: tuple[int, int] = (8, 60)
    a_max_tokens: int = 4
    # (b)
    b_rounds: int = 8
    b_system_words: int = 380
    # (c)
    c_rounds: int = 5
    c_others: int = 4
    c_words: int = 750
    # (d)
    d_requests: int = 48
    d_concurrency: int = 16
    d_words: tuple[int, int] = (8, 60)
    d_max_tokens: int = 16
    # (e)
    e_images: int = 64
    e_size: tuple[int, int] = (640, 480)

    @property
    def model_name(self) -> str:
        return (f"Qwen2-VL-random-lm{self.lm_hidden}x{self.lm_layers}-vit{self.tower_dim}x{self.tower_depth}"
                f"-tok-smollm2")


FULL = Scale()
QUICK = replace(FULL, lm_hidden=128, lm_layers=2, lm_intermediate=256, lm_heads=2, lm_kv_heads=1, tower_dim=64,
                tower_depth=2, tower_heads=1, max_pixels=64 * 28 * 28, image_size=(224, 168), kv_blocks=512,
                a_requests=20, a_images=6, b_rounds=2, b_system_words=60, c_rounds=1, c_others=2, c_words=120,
                d_requests=8, d_concurrency=4, e_images=8)


# ---- the model ---------------------------------------------------------------------------

def ensure_model(scale: Scale) -> Path:
    from engine.checkpoint import cache_dir, file_lock

    target = cache_dir() / "models" / scale.model_name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{scale.model_name}.lock"):
        if not (target / "config.json").is_file():
            print(f"building {target} (once)", flush=True)
            build_model(scale, target)
    return target


def build_model(scale: Scale, target: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from engine.checkpoint import ensure_default_model

    # A real 49k-token vocabulary, so texts take realistic token counts.
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    tokenizer.add_tokens(QWEN_VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] in ('image', 'image_url') or 'image' in part %}" + IMAGE_PLACEHOLDER +
        "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS)))
    head_dim = scale.lm_hidden // scale.lm_heads
    # M-RoPE's (time, height, width) sections must sum to head_dim / 2; Qwen2-VL splits 1:1.5:1.5.
    time_section = head_dim // 8
    sections = [time_section, (head_dim // 2 - time_section) // 2, head_dim // 2 - time_section
                - (head_dim // 2 - time_section) // 2]
    text = dict(vocab_size=len(tokenizer), hidden_size=scale.lm_hidden, intermediate_size=scale.lm_intermediate,
                num_hidden_layers=scale.lm_layers, num_attention_heads=scale.lm_heads,
                num_key_value_heads=scale.lm_kv_heads, max_position_embeddings=8192, use_sliding_window=False,
                rope_scaling={"type": "mrope", "mrope_section": sections}, rope_theta=1_000_000.0,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                tie_word_embeddings=True)
    vision = dict(depth=scale.tower_depth, embed_dim=scale.tower_dim, hidden_size=scale.lm_hidden,
                  num_heads=scale.tower_heads, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=None, **ids)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    processor = Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=scale.max_pixels, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        processor.save_pretrained(staging)
        os.chmod(staging, 0o755)
        os.replace(staging, target)  # a complete folder or none
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def describe_model(path: Path, scale: Scale) -> dict:
    """Parameter counts, embeddings per request image, and the cost of the two halves on one
    core (as each runs in the server): tower per image embedding vs language model per token."""
    import torch
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from engine.adapters import adapter_for

    model = Qwen2VLForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa").eval()
    params = {name: p.numel() for name, p in model.named_parameters()}
    tower = sum(n for name, n in params.items() if ".visual." in f".{name}")
    merger = sum(n for name, n in params.items() if "visual.merger" in name)
    embedding = model.get_input_embeddings().weight.numel()
    lm = sum(params.values()) - tower - embedding  # tied lm_head: counted once, in embedding
    merge = model.config.vision_config.spatial_merge_size ** 2
    # Per embedding the tower runs `merge` patches through its blocks, then the merger once.
    tower_flops = 2 * (merge * (tower - merger) + merger)
    lm_flops = 2 * lm
    adapter = adapter_for(path, AutoConfig.from_pretrained(path))
    item = adapter.process_image(photo(0, scale.image_size))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            pixels = torch.from_numpy(item.tower_input)
            grid = torch.tensor([item.grid])
            model.model.visual(pixels, grid_thw=grid)
            tower_s = min(_timed(lambda: model.model.visual(pixels, grid_thw=grid)) for _ in range(3))
            n = 512
            embeds = torch.randn(1, n, scale.lm_hidden)
            positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)
            language_model = model.model.language_model
            language_model(inputs_embeds=embeds, position_ids=positions)
            lm_s = min(_timed(lambda: language_model(inputs_embeds=embeds, position_ids=positions))
                       for _ in range(2))
    finally:
        torch.set_num_threads(threads)
    del model
    gc.collect()
    return dict(tower_params=tower, lm_params=lm, embedding_params=embedding, embeddings_per_image=item.num_embeddings,
                patches_per_image=item.tower_input.shape[0], flops_ratio=tower_flops / lm_flops,
                tower_ms_per_embedding=tower_s * 1000 / item.num_embeddings, lm_ms_per_token=lm_s * 1000 / n,
                tower_ms_per_image=tower_s * 1000, max_embeddings=adapter.max_embeddings_per_item())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- inputs --------------------------------------------------------------------------------

def photo(seed: int, size: tuple[int, int]):
    """A photo-like picture: smooth colour fields plus grain, so JPEG sizes are realistic
    (pure noise compresses badly, flat colour too well). Distinct per seed."""
    import numpy as np
    import PIL.Image

    rng = np.random.default_rng(seed)
    coarse = PIL.Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, PIL.Image.BICUBIC)
    grain = rng.normal(0, 10, (size[1], size[0], 3))
    return PIL.Image.fromarray(np.clip(np.asarray(coarse, dtype=np.float64) + grain, 0, 255).astype(np.uint8))


def jpeg_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def raw_prompt(text_before: str, question: str) -> str:
    """One user turn with one image, as the model's chat template writes it."""
    return (f"<|im_start|>user\n{text_before}{IMAGE_PLACEHOLDER}{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


# ---- offline engine --------------------------------------------------------------------------

def new_llm(path: Path, scale: Scale, **config):
    from engine import LLM

    llm = LLM(str(path), num_kv_blocks=scale.kv_blocks, **config)
    # The first forward passes and encodes pay for lazy initialisation: not part of any timing.
    warm = [{"prompt": raw_prompt(f"Warm-up {i}: hello there.", " What is it?"),
             "multi_modal_data": {"image": [photo(10_000 + i, scale.image_size)]}} for i in range(2)]
    run_side_by_side([OfflineRun(llm, warm, 2, 2)])
    llm.engine.core.reset_prefix_cache()
    return llm


class OfflineRun:
    """One engine working through its requests in a closed loop (at most `concurrency` in
    flight, as clients would send them, each generating exactly `max_tokens`), advanced one
    step at a time so that several engines can take turns; each is timed only while it runs."""

    def __init__(self, llm, prompts: list, max_tokens: int, concurrency: int) -> None:
        from engine import SamplingParams

        self.llm = llm
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.pending = deque(prompts)
        self.concurrency = concurrency
        self.in_flight = 0
        self.seconds = 0.0
        self.stats_before = llm.engine.stats()

    @property
    def done(self) -> bool:
        return not self.pending and not self.in_flight

    def advance(self) -> None:
        engine = self.llm.engine
        start = time.perf_counter()
        # Adding a request preprocesses and hashes its image: timed, as the server pays for it too.
        while self.pending and self.in_flight < self.concurrency:
            engine.add_request(self.pending.popleft(), self.params)
            self.in_flight += 1
        if not engine.has_unfinished_requests:
            raise RuntimeError("the engine went idle with requests in flight")
        for out in engine.step():
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                self.in_flight -= 1
        self.seconds += time.perf_counter() - start

    def stats(self) -> dict:
        after = self.llm.engine.stats()
        names = ("encoder_items_requested", "encoder_items_encoded", "encoder_cache_queries", "encoder_cache_hits",
                 "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "image_tokens_in")
        return {name: getattr(after, name) - getattr(self.stats_before, name) for name in names}


def run_side_by_side(runs: list[OfflineRun]) -> None:
    """Step the engines in turn, the first to go alternating, until all are done. This machine
    shares its cores with other work and drifts by up to 1.5x over minutes; runs one after the
    other would compare different machines, while engines taking turns step by step see the
    same one."""
    turn = 0
    while not all(run.done for run in runs):
        for run in (runs if turn % 2 == 0 else runs[::-1]):
            if not run.done:
                run.advance()
        turn += 1


def measure_encoder_reuse(path: Path, scale: Scale, embeddings_per_image: int) -> dict:
    """(a) The same requests on two fresh engines taking turns: global encoder cache on (default
    size, encoder_cache_gib) and off; the decoder's budget is the default in both."""
    rng = random.Random(1)
    images = [photo(100 + i, scale.image_size) for i in range(scale.a_images)]
    # Every image at least once, then at random: a working set of 30 images, reused ~3 times.
    order = list(range(scale.a_images)) + [rng.randrange(scale.a_images)
                                           for _ in range(scale.a_requests - scale.a_images)]
    rng.shuffle(order)
    prompts = [{"prompt": raw_prompt(f"Request {i}: {words(rng, rng.randint(*scale.a_words))}. ",
                                     " Describe this picture in one line."),
                "multi_modal_data": {"image": [images[k]]}} for i, k in enumerate(order)]
    engines = {"on": new_llm(path, scale, enable_encoder_cache=True),
               "off": new_llm(path, scale, enable_encoder_cache=False)}
    decoder_budget = engines["on"].engine.core.sizes.encoder_budget
    global_cache = engines["on"].engine.core.embedding_source.cache.budget
    runs = {name: OfflineRun(llm, prompts, scale.a_max_tokens, scale.a_concurrency) for name, llm in engines.items()}
    run_side_by_side(list(runs.values()))
    result = {name: (run.seconds, run.stats()) for name, run in runs.items()}
    del engines, runs
    gc.collect()
    return dict(result, decoder_budget=decoder_budget, global_cache=global_cache,
                images_held=global_cache // embeddings_per_image)


def measure_cache_cost(path: Path, scale: Scale) -> dict:
    """(d) Both caches on vs both off when nothing ever hits: every request has its own image
    and its own text from the first token. Two engines take turns step by step; each of two
    rounds gives both a fresh set of requests; best of 2. The caching engine still holds the
    last round's entries, so it also pays for evicting them, as a server would."""
    engines = {"on": new_llm(path, scale, enable_prefix_caching=True, enable_encoder_cache=True),
               "off": new_llm(path, scale, enable_prefix_caching=False, enable_encoder_cache=False)}
    times: dict[str, list[float]] = {"on": [], "off": []}
    stats = {}
    for round_index in range(2):
        rng = random.Random(50 + round_index)
        base = 1000 * (round_index + 1)
        prompts = [{"prompt": raw_prompt(f"Case {base + i}: {words(rng, rng.randint(*scale.d_words))}. ",
                                         " What stands out here?"),
                    "multi_modal_data": {"image": [photo(base + i, scale.image_size)]}}
                   for i in range(scale.d_requests)]
        runs = {name: OfflineRun(llm, prompts, scale.d_max_tokens, scale.d_concurrency)
                for name, llm in engines.items()}
        run_side_by_side(list(runs.values()) if round_index == 0 else list(runs.values())[::-1])
        for name, run in runs.items():
            times[name].append(run.seconds)
            stats[name] = run.stats()
    del engines
    gc.collect()
    return dict(on=min(times["on"]), off=min(times["off"]), all_on=times["on"], all_off=times["off"],
                stats_on=stats["on"], requests=scale.d_requests)


# ---- the server ----------------------------------------------------------------------------

class PinnedServer:
    """`python -m frontend.cli serve` with the encoder process pinned to core 0 and the decoder
    process to core 1: every thread of each (sched_setaffinity on a pid moves only its main
    thread), and one OpenMP thread each (two spinning threads on one core would fight)."""

    def __init__(self, model: Path, scale: Scale, log_dir: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log_path = log_dir / "server.log"
        self.log = open(self.log_path, "w")
        command = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(model), "--port", str(self.port),
                   "--num-kv-blocks", str(scale.kv_blocks), "--max-message-bytes", str(64 << 20)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        self.pinned = {"encoder": self._pin("workers.encoder_process", {0}),
                       "decoder": self._pin("workers.decoder_process", {1})}

    def _healthy(self) -> bool:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False

    def _pin(self, module: str, cores: set[int]) -> int:
        import psutil

        children = [c for c in psutil.Process(self.process.pid).children() if module in " ".join(c.cmdline())]
        if len(children) != 1:
            raise RuntimeError(f"expected one {module} child of the server, found {len(children)}")
        pid = children[0].pid
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cores)
        return pid

    def chat(self, messages: list[dict], max_tokens: int = 1) -> tuple[float, dict]:
        """(seconds, response). With max_tokens=1 the response is complete at the first token:
        its latency is the time to first token, from the first byte sent."""
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = json.loads(response.read())
        seconds = time.perf_counter() - start
        connection.close()
        if response.status != 200:
            raise RuntimeError(f"request failed ({response.status}): {payload}")
        return seconds, payload

    def metric(self, name: str) -> float:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
        connection.close()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def image_turn(text_before: str, url: str, question: str) -> dict:
    parts = [{"type": "text", "text": text_before}] if text_before else []
    parts += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return {"role": "user", "content": parts}


def warm_server(server: PinnedServer, scale: Scale) -> None:
    """Lazy initialisation and first-call costs out of the way: an image request, a long text."""
    rng = random.Random(7)
    for i in range(2):
        url = jpeg_data_url(photo(20_000 + i, scale.image_size))
        server.chat([image_turn(f"Warm-up {i}: {words(rng, 40)}", url, " What is this?")], max_tokens=4)
    server.chat([{"role": "user", "content": f"Warm-up long: {words(rng, scale.c_words)}"}], max_tokens=2)


def measure_cached_ttft(server: PinnedServer, path: Path, scale: Scale) -> dict:
    """(b) Per round: a new system text and image with question A (cold: nothing cached, the
    image not encoded yet), then the same system text and image with question B (same token
    count): everything but the question comes from the prefix cache. Then, to see what the
    image adds to a cached request, the same system text and question without the image, and
    a one-line text request: the floor of any request (one decoder step and the path).
    Medians over rounds."""
    from engine.adapters import adapter_for
    from engine.media import MediaLimits, load_image
    from transformers import AutoConfig

    rng = random.Random(3)
    cold, warm, ideal, tokens, cached, text_only, text_computed, floor = [], [], [], [], [], [], [], []
    for k in range(scale.b_rounds):
        system = {"role": "system", "content": f"Briefing {k}: {words(rng, scale.b_system_words)}."}
        url = jpeg_data_url(photo(300 + k, scale.image_size))
        seconds, answer = server.chat([system, image_turn("", url, f" Question A{k}: what is shown, and where?")])
        cold.append(seconds)
        time.sleep(0.3)
        seconds, answer = server.chat([system, image_turn("", url, f" Question B{k}: what is shown, and where?")])
        warm.append(seconds)
        usage = answer["usage"]
        prompt, hit = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        tokens.append(prompt)
        cached.append(hit)
        ideal.append(prompt / (prompt - hit))
        time.sleep(0.3)
        question = {"role": "user", "content": f" Question C{k}: what is shown, and where?"}
        seconds, answer = server.chat([system, question])
        text_only.append(seconds)
        usage = answer["usage"]
        text_computed.append(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.3)
        seconds, answer = server.chat([{"role": "user", "content": f"Hello {k}"}])
        floor.append((seconds, answer["usage"]["prompt_tokens"]))
        time.sleep(0.3)
    # What a cached request still pays for before the decoder: its image is decoded,
    # preprocessed and hashed in the frontend every time (one pool thread, timed here alone).
    adapter = adapter_for(path, AutoConfig.from_pretrained(path))
    limits = MediaLimits()
    url = jpeg_data_url(photo(300, scale.image_size))
    preprocess = statistics.median(_timed(lambda: adapter.process_image(load_image(url, limits))) for _ in range(7))
    return dict(cold=statistics.median(cold), warm=statistics.median(warm), ideal=statistics.median(ideal),
                prompt_tokens=statistics.median(tokens), cached_tokens=statistics.median(cached),
                all_cold=cold, all_warm=warm, preprocess=preprocess, text_only=statistics.median(text_only),
                text_computed=statistics.median(text_computed), floor=statistics.median(f for f, _ in floor),
                floor_tokens=floor[0][1])


def measure_overlap(server: PinnedServer, scale: Scale) -> dict:
    """(c) A request with a long text before its image, sent while the encoder has other
    requests' images to encode first.

    Ours: the decoder prefills the long text on its core while the encoder encodes on the
    other. No switch makes the decoder wait for the embeddings first, so that baseline is
    estimated from two measured parts: T_emb, the time from sending the request until the
    encoder has encoded its image (polling the encoder's counter in /metrics every 10 ms during
    the same run), plus T_after, the TTFT of the same burst sent again with a different first
    word in every text (no prefix hit) while every image is in the encoder cache: the decoder
    then finds all embeddings ready at once, and has to prefill everything, as it would after
    waiting. Assumes the waiting engine would prefill nothing of the burst before T_emb, which
    holds when the burst's images are encoded in one batch (up to 8)."""
    rng = random.Random(4)
    ours, t_emb, t_after = [], [], []
    for r in range(scale.c_rounds):
        others = [(f"Other {r}-{j}: {words(rng, 8)}", jpeg_data_url(photo(400 + 10 * r + j, scale.image_size)))
                  for j in range(scale.c_others)]
        long_text = words(rng, scale.c_words)
        url = jpeg_data_url(photo(490 + r, scale.image_size))
        encoded_before = server.metric("antiphon_encoder_items_encoded_total")

        def burst(tag: str, watch_encoder: bool) -> tuple[float, float | None]:
            threads = [threading.Thread(target=server.chat, args=([image_turn(f"{tag} {text} ", other,
                                                                              " Describe it.")],))
                       for text, other in others]
            for thread in threads:
                thread.start()
            time.sleep(0.05)  # the others reach the encoder first
            embedded: list[float] = []
            sent = time.perf_counter()
            if watch_encoder:
                target = encoded_before + scale.c_others + 1

                def watch() -> None:
                    while server.metric("antiphon_encoder_items_encoded_total") < target:
                        if time.perf_counter() - sent > 120:
                            return  # reported as a failed measurement below
                        time.sleep(0.01)
                    embedded.append(time.perf_counter() - sent)

                watcher = threading.Thread(target=watch)
                watcher.start()
            seconds, _ = server.chat([image_turn(f"{tag} report {r}: {long_text} ", url, " So, what is it?")])
            for thread in threads:
                thread.join()
            if watch_encoder:
                watcher.join()
            if watch_encoder and not embedded:
                raise RuntimeError("the encoder never counted this round's images as encoded")
            return seconds, embedded[0] if embedded else None

        seconds, emb = burst("First", watch_encoder=True)
        ours.append(seconds)
        t_emb.append(emb)
        time.sleep(0.3)
        seconds, _ = burst("Again", watch_encoder=False)
        t_after.append(seconds)
        time.sleep(0.3)
    estimate = [e + a for e, a in zip(t_emb, t_after)]
    return dict(ours=statistics.median(ours), t_emb=statistics.median(t_emb), t_after=statistics.median(t_after),
                wait_first=statistics.median(estimate), all_ours=ours, all_estimate=estimate)


# ---- frontend preprocessing ------------------------------------------------------------------

_WORKER_ADAPTER = None


def _init_worker(path: str) -> None:
    global _WORKER_ADAPTER
    from transformers import AutoConfig

    from engine.adapters import adapter_for

    _WORKER_ADAPTER = adapter_for(Path(path), AutoConfig.from_pretrained(path))


def _preprocess(url: str):
    """What the frontend's pool does per image: decode the data URL, then pixels + hash."""
    from engine.media import MediaLimits, load_image

    return _WORKER_ADAPTER.process_image(load_image(url, MediaLimits()))


def measure_preprocessing(path: Path, scale: Scale) -> dict:
    """(e) Images/s through decode + preprocess + hash, with 1 and 2 threads (the frontend's
    pool) and 2 processes (no GIL between them, but the pixels travel back pickled: that is
    what a process pool in the frontend would pay too). Each pool is warmed up first."""
    import multiprocessing

    urls = [jpeg_data_url(photo(600 + i, scale.e_size)) for i in range(scale.e_images)]
    _init_worker(str(path))
    embeddings = _preprocess(urls[0]).num_embeddings
    pools = {"1 thread": ThreadPoolExecutor(1), "2 threads": ThreadPoolExecutor(2),
             "2 processes": ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_init_worker, initargs=(str(path),))}
    rates: dict[str, float] = {name: 0.0 for name in pools}
    try:
        for pool in pools.values():
            list(pool.map(_preprocess, urls[:4]))
        # Three rounds, the pools taking turns, best of each: the cores are shared with other work.
        for _ in range(3):
            for name, pool in pools.items():
                start = time.perf_counter()
                results = list(pool.map(_preprocess, urls))
                rates[name] = max(rates[name], len(results) / (time.perf_counter() - start))
    finally:
        for pool in pools.values():
            pool.shutdown()
    size = sum(len(u) for u in urls) / len(urls)
    return dict(rates=rates, embeddings=embeddings, url_kib=size / 1024)


# ---- report --------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and workloads (< 1 minute)")
    parser.add_argument("--skip", nargs="*", default=[], choices=list("abcde"), help="measurements to leave out")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    scale = QUICK if args.quick else FULL
    started = time.perf_counter()
    # Other work shares these cores; the load says how much of it there was.
    load_at_start = os.getloadavg()
    path = ensure_model(scale)
    model = describe_model(path, scale)
    print(f"\nModel: {path.name} (random weights, Qwen2-VL architecture), float32.")
    print(f"  vision tower {model['tower_params'] / 1e6:.1f}M parameters (ViT {scale.tower_depth} x {scale.tower_dim} "
          f"+ 2x2 merger); language model {model['lm_params'] / 1e6:.1f}M ({scale.lm_layers} x {scale.lm_hidden}) "
          f"+ {model['embedding_params'] / 1e6:.1f}M embedding table (tied)")
    print(f"  request image {scale.image_size[0]}x{scale.image_size[1]}: {model['patches_per_image']} patches -> "
          f"{model['embeddings_per_image']} embeddings (at most {model['max_embeddings']} per image)")
    print(f"  tower / language model per embedding vs per token: {model['flops_ratio']:.2f} by FLOPs; on one core "
          f"{model['tower_ms_per_embedding']:.2f} / {model['lm_ms_per_token']:.2f} ms = "
          f"{model['tower_ms_per_embedding'] / model['lm_ms_per_token']:.2f} "
          f"({model['tower_ms_per_image']:.0f} ms per image)")
    # Measured in the order offline, server, preprocessing (one server for b and c); shown a to e.
    rows: dict[str, list[tuple[str, str]]] = {}
    notes: dict[str, str] = {}
    if "a" not in args.skip:
        rows["a"] = report_encoder_reuse(measure_encoder_reuse(path, scale, model["embeddings_per_image"]), scale,
                                         notes)
    if "d" not in args.skip:
        rows["d"] = report_cache_cost(measure_cache_cost(path, scale), scale)
    if "b" not in args.skip or "c" not in args.skip:
        log_dir = Path(tempfile.mkdtemp(prefix="antiphon-mm-bench-"))
        server = PinnedServer(path, scale, log_dir)
        print(f"\nServer: encoder process (pid {server.pinned['encoder']}) pinned to core 0, decoder process "
              f"(pid {server.pinned['decoder']}) to core 1, one OpenMP thread each; frontend and client unpinned.")
        try:
            warm_server(server, scale)
            if "b" not in args.skip:
                rows["b"] = report_cached_ttft(measure_cached_ttft(server, path, scale), scale, notes)
            if "c" not in args.skip:
                rows["c"] = report_overlap(measure_overlap(server, scale), scale, notes)
        except Exception:
            print(server.log_path.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    if "e" not in args.skip:
        rows["e"] = report_preprocessing(measure_preprocessing(path, scale), scale)
    print("\n| measurement | result |\n|---|---|")
    for letter in sorted(rows):
        for name, result in rows[letter]:
            print(f"| {name} | {result} |")
    for letter in sorted(notes):
        print(f"\n- {notes[letter]}")
    print(f"\nTotal {time.perf_counter() - started:.0f} s. Load average (1, 5, 15 min) at start "
          f"{', '.join(f'{x:.2f}' for x in load_at_start)}, at end {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(this run alone keeps about 2 busy).")


def report_encoder_reuse(a: dict, scale: Scale, notes: dict[str, str]) -> list[tuple[str, str]]:
    (on_s, on), (off_s, off) = a["on"], a["off"]
    rows = [(f"(a) {scale.a_requests} requests over {scale.a_images} distinct images after different texts "
             f"(offline, {scale.a_concurrency} in flight, {scale.a_max_tokens} output tokens): encoder runs, "
             f"global encoder cache on (default 1 GiB: {a['global_cache']:,} embeddings, {a['images_held']:,} "
             f"of these images) / off",
             f"**{on['encoder_items_encoded']}** / {off['encoder_items_encoded']} (the decoder asked "
             f"{on['encoder_items_requested']} / {off['encoder_items_requested']} times)"),
            ("(a) total time, encoder cache on / off (same requests, engines taking turns step by step)",
             f"{on_s:.1f} s / {off_s:.1f} s: **{off_s / on_s:.2f}x** faster with the cache")]
    notes["a"] = (f"(a) {on['image_tokens_in']} image tokens per run; the decoder's own budget "
                  f"{a['decoder_budget']:,} embeddings in both; prefix-cache hits "
                  f"{on['prefix_cache_hit_tokens']} "
                  f"tokens (a different text before every image, so the prefix cache never covers one); the decoder "
                  f"asks once per image held by requests in flight at the same time, so even with the cache off the "
                  f"encoder ran fewer than {scale.a_requests} times.")
    return rows


def report_cache_cost(d: dict, scale: Scale) -> list[tuple[str, str]]:
    cost = d["on"] / d["off"] - 1
    stats = d["stats_on"]
    return [(f"(d) 0% hit rate: {d['requests']} requests, each its own image and text ({scale.d_concurrency} in "
             f"flight, {scale.d_max_tokens} output tokens): requests/s, prefix + encoder caches on vs off "
             f"(engines taking turns, best of 2 rounds)",
             f"{d['requests'] / d['on']:.2f} vs {d['requests'] / d['off']:.2f} = cost **{cost:+.1%}** "
             f"(runs on {', '.join(f'{s:.1f}' for s in d['all_on'])} s, off "
             f"{', '.join(f'{s:.1f}' for s in d['all_off'])} s; hits: {stats['prefix_cache_hit_tokens']} prefix "
             f"tokens, {stats['encoder_cache_hits']} encoder items)")]


def report_cached_ttft(b: dict, scale: Scale, notes: dict[str, str]) -> list[tuple[str, str]]:
    ratio = b["cold"] / b["warm"]
    uncached = b["prompt_tokens"] - b["cached_tokens"]
    notes["b"] = (f"(b) cold TTFTs {', '.join(f'{s * 1000:.0f}' for s in b['all_cold'])} ms; cached "
                 f"{', '.join(f'{s * 1000:.0f}' for s in b['all_warm'])} ms. A cached request still has its "
                 f"image decoded, preprocessed and hashed by the frontend: {b['preprocess'] * 1000:.1f} ms "
                 f"alone on an idle core. The same system text and question without the image (also cached): "
                 f"{b['text_only'] * 1000:.0f} ms for {b['text_computed']:.0f} computed tokens. A "
                 f"{b['floor_tokens']}-token text request, nothing cached: {b['floor'] * 1000:.0f} ms (a decoder step "
                 f"has a floor: on one core it reads every language-model weight and the whole output matrix, however "
                 f"few tokens it computes); "
                 f"the ideal ratio assumes time proportional to tokens.")
    return [(f"(b) TTFT, system text ({scale.b_system_words} words) + image + question: cold / all but the "
             f"question cached (server, median of {scale.b_rounds})",
             f"{b['cold'] * 1000:.0f} ms / {b['warm'] * 1000:.0f} ms = **{ratio:.1f}x**; ideal {b['ideal']:.1f}x "
             f"({b['prompt_tokens']:.0f} prompt tokens / {uncached:.0f} computed): **{ratio / b['ideal']:.0%} of "
             f"ideal**")]


def report_overlap(c: dict, scale: Scale, notes: dict[str, str]) -> list[tuple[str, str]]:
    notes["c"] = (f"(c) TTFT ours {', '.join(f'{s * 1000:.0f}' for s in c['all_ours'])} ms; wait-first estimates "
                 f"{', '.join(f'{s * 1000:.0f}' for s in c['all_estimate'])} ms. The wait-first TTFT is an "
                 f"estimate (no switch exists): T_emb (request sent -> its image encoded, measured) + T_after "
                 f"(the same burst again with every image in the encoder cache and nothing in the prefix cache).")
    return [(f"(c) TTFT, {scale.c_words} words of text before an image, sent while the encoder has "
             f"{scale.c_others} other requests' images queued: prefill beside encoding / wait for the "
             f"embeddings first (estimate: T_emb {c['t_emb'] * 1000:.0f} ms + T_after {c['t_after'] * 1000:.0f} ms)",
             f"{c['ours'] * 1000:.0f} ms / {c['wait_first'] * 1000:.0f} ms = **{c['wait_first'] / c['ours']:.2f}x** "
             f"faster (median of {scale.c_rounds})")]


def report_preprocessing(e: dict, scale: Scale) -> list[tuple[str, str]]:
    rates = e["rates"]
    one = rates["1 thread"]
    return [(f"(e) frontend preprocessing, {scale.e_size[0]}x{scale.e_size[1]} JPEG data URL "
             f"({e['url_kib']:.0f} KiB) -> decoded, resized, patchified, hashed ({e['embeddings']} embeddings): "
             f"images/s", "; ".join(f"{name} {rate:.1f} ({rate / one:.2f}x)" for name, rate in rates.items()))]


if __name__ == "__main__":
    main()

"""Static-cache generation through backend="tpu": `model.generate(cache_implementation="static")`
with `model.forward` compiled, on every Transformers causal-LM family that can compile its forward
as one graph (`_can_compile_fullgraph`), each built from a tiny config with random weights.

    python bench/generate.py --jobs 2                     # every family, resumable
    python bench/generate.py --only llama mixtral         # rerun these, keep the others

Per family: greedy generation of NEW_TOKENS tokens from a PROMPT-token prompt; the tokens must be
identical to eager's. Entries `buckets/<family>` generate from prompts of several lengths with one
declared maximum (`mark_dynamic(input_ids, 1, max=MAX_PROMPT)`, buckets "pow2", a fixed
`max_cache_len`) and count XLA compiles against `dynamic=False` (one compile per prompt length).
Results: bench/results/generate.{json,md}.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402
import sweep_runner  # noqa: E402
import tiny  # noqa: E402

VOCAB = sweep.VOCAB
SLIDING = 8
PROMPT = 7
NEW_TOKENS = 16
MAX_PROMPT = 32
MAX_CACHE = MAX_PROMPT + NEW_TOKENS
BUCKET_LENGTHS = (3, 5, 7, 9, 12, 17, 23, 30)
BUCKET_FAMILIES = ("llama", "qwen3_moe")

# Widely used families run first (the sweep is resumable; the rest follow in mapping order).
PRIORITY = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "deepseek_v3",
    "qwen2_moe",
    "cohere",
    "starcoder2",
    "gpt2",
    "gpt_neox",
    "phi",
    "opt",
    "falcon",
    "stablelm",
    "olmoe",
    "smollm3",
    "glm",
    "exaone4",
    "gpt_oss",
    "llama4_text",
)


def families() -> list[str]:
    """The causal-LM model types whose class can compile its forward as one graph."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M

    out = []
    for model_type, cls_name in M.items():
        cls = getattr(transformers, cls_name, None)
        if cls is not None and getattr(cls, "_can_compile_fullgraph", False):
            out.append(model_type)
    return out


def excluded() -> list[str]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M

    return [
        t
        for t, c in M.items()
        if not getattr(getattr(transformers, c, None), "_can_compile_fullgraph", False)
    ]


def tiny_config(model_type: str):
    """The family's tiny causal-LM config exactly as bench/sweep.py builds it (hidden 64, 2 layers,
    4 heads of 16, 2 KV heads, 4 experts with 2 per token, vocab 512, the per-family recipes),
    with a sliding window of SLIDING where the family has one, so that a prompt and its new tokens
    cross it."""
    cfg = sweep.config_for("causal_lm", model_type)
    for c in tiny.sub_configs(cfg):
        if isinstance(vars(c).get("sliding_window"), int):
            c.sliding_window = SLIDING
    return cfg


def from_config(cfg, cls=None):
    """The causal LM of `cfg` (of class `cls`, else AutoModelForCausalLM's for `cfg`) with seeded
    random weights, in eval mode, generating exactly the tokens asked for (no end-of-sequence
    token)."""
    import transformers

    torch.manual_seed(0)
    model = (cls._from_config(cfg) if cls else transformers.AutoModelForCausalLM.from_config(cfg)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build(model_type: str):
    # The mapping's own class: a multimodal type's text config need not be one AutoModelForCausalLM
    # knows (emu3 -> Emu3ForCausalLM takes Emu3TextConfig).
    return from_config(tiny_config(model_type), sweep._model_class("causal_lm", model_type))


def generate(model, ids, new_tokens: int = NEW_TOKENS, **kw):
    """Greedy generation of `new_tokens` tokens with a static KV cache, `model.forward` as it is
    (Transformers' own compile switched off: the caller decides what is compiled)."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,
            **kw,
        )


_generate = generate


def work_family(model_type: str) -> dict:
    import tpuc

    res = {"name": model_type, "built": False, "tpu_ok": None}
    t0 = time.time()
    try:
        model = build(model_type)
        torch.manual_seed(1)
        ids = torch.randint(3, VOCAB, (1, PROMPT))
        expected = _generate(model, ids)
    except Exception as e:  # noqa: BLE001
        res["error"] = "build/eager: " + sweep_runner.short_error(e)
        return res
    res["built"] = True
    res["class"] = type(model).__name__
    res["eager_s"] = round(time.time() - t0, 2)
    eager_forward = model.forward

    t0 = time.time()
    tpuc.reset_stats()
    try:
        model.forward = torch.compile(eager_forward, backend="tpu", options={"fallback": "error"})
        actual = _generate(model, ids)
        res["tpu_ok"] = bool(torch.equal(actual, expected))
        res["tokens_equal"] = (
            int((actual[0, PROMPT:] == expected[0, PROMPT:]).sum()) if actual.shape == expected.shape else 0
        )
        if not res["tpu_ok"]:
            res["error"] = f"tokens differ: {res['tokens_equal']}/{NEW_TOKENS} equal"
    except Exception as e:  # noqa: BLE001
        res["tpu_ok"] = False
        res["error"] = sweep_runner.short_error(e)
    s = tpuc.stats()
    res["graphs"] = s["graphs_compiled"]
    res["xla_compiles"] = s["xla_compiles"]
    res["executions"] = s["executions"]
    res["tpu_s"] = round(time.time() - t0, 2)

    if not res["tpu_ok"]:
        # Is it torch's? The same generation with backend="aot_eager".
        torch._dynamo.reset()
        t0 = time.time()
        try:
            model.forward = torch.compile(eager_forward, backend="aot_eager")
            res["aot_eager_ok"] = bool(torch.equal(_generate(model, ids), expected))
        except Exception as e:  # noqa: BLE001
            res["aot_eager_ok"] = False
            res["aot_eager_error"] = sweep_runner.short_error(e)
        res["aot_eager_s"] = round(time.time() - t0, 2)
    return res


def bucketed_forward(forward, options: dict, max_len: int):
    """`forward` compiled with backend="tpu", each prompt's `input_ids` marked dynamic up to
    `max_len` (a decode step's single token stays static)."""
    compiled = torch.compile(forward, backend="tpu", options=options)

    def call(*args, **kw):
        ids = kw.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            torch._dynamo.mark_dynamic(ids, 1, min=2, max=max_len)
        return compiled(*args, **kw)

    return call


def work_buckets(name: str) -> dict:
    import tpuc

    model_type = name.split("/", 1)[1]
    model = build(model_type)
    model.generation_config.max_cache_len = MAX_CACHE  # one cache size for every prompt
    eager_forward = model.forward
    torch.manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (1, n)) for n in BUCKET_LENGTHS]
    expected = [_generate(model, p) for p in prompts]
    res = {"name": name, "built": True, "lengths": list(BUCKET_LENGTHS), "max_prompt": MAX_PROMPT}
    # No disk cache: every executable a variant needs is compiled (and counted) here.
    opts = {"fallback": "error", "cache_dir": None}
    variants = {
        "buckets": lambda: bucketed_forward(eager_forward, opts | {"buckets": "pow2"}, MAX_PROMPT),
        "static": lambda: torch.compile(eager_forward, backend="tpu", dynamic=False, options=opts),
    }
    ok = True
    for variant, make in variants.items():
        torch._dynamo.reset()
        tpuc.reset_stats()
        t0 = time.time()
        model.forward = make()
        same = [bool(torch.equal(_generate(model, p), e)) for p, e in zip(prompts, expected, strict=True)]
        s = tpuc.stats()
        res[variant] = {
            "tokens_identical": all(same),
            "identical_per_prompt": same,
            "graphs": s["graphs_compiled"],
            "xla_compiles": s["xla_compiles"],
            "seconds": round(time.time() - t0, 2),
        }
        ok &= all(same)
    res["tpu_ok"] = ok
    if not ok:
        res["error"] = "tokens differ for some prompt"
    return res


def work(name: str) -> dict:
    logging_off()
    torch.set_num_threads(int(os.environ.get("SWEEP_THREADS", "1")))
    return work_buckets(name) if name.startswith("buckets/") else work_family(name)


def logging_off() -> None:
    import logging
    import warnings

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _aot_note(r: dict) -> str:
    return sweep_runner.cell(f" (aot_eager: {r['aot_eager_error']})") if r.get("aot_eager_error") else ""


def markdown(results: list[dict]) -> str:
    fam = [r for r in results if not r["name"].startswith("buckets/")]
    buck = [r for r in results if r["name"].startswith("buckets/")]
    built = sum(bool(r.get("built")) for r in fam)
    ok = sum(r.get("tpu_ok") is True for r in fam)
    lines = [
        "# Static-cache generation (bench/generate.py)",
        "",
        f"{len(fam)} causal-LM families with `_can_compile_fullgraph`; built and generated in eager "
        f'with a static cache: {built}; tokens identical to eager with backend="tpu": {ok}. '
        f'Greedy, prompt {PROMPT} tokens, {NEW_TOKENS} new tokens, fallback="error".',
        "",
    ]
    rows = []
    for r in fam:
        aot = {True: "ok", False: "**fails**"}.get(r.get("aot_eager_ok"), "")
        rows.append(
            [
                r["name"],
                r.get("class", ""),
                sweep_runner.cell(bool(r.get("built"))),
                sweep_runner.cell(r.get("tpu_ok")),
                r.get("graphs", ""),
                r.get("xla_compiles", ""),
                aot,
                r.get("wall_s", ""),
                sweep_runner.error_cell({"error": r.get("error")}) + _aot_note(r),
            ]
        )
    header = [
        "family",
        "class",
        "built",
        "tokens identical",
        "graphs",
        "XLA compiles",
        "aot_eager",
        "wall s",
        "error",
    ]
    lines += sweep_runner.table(header, rows, right=(4, 5, 7))
    if buck:
        lines += [
            "",
            f"## Prompts of lengths {', '.join(map(str, BUCKET_LENGTHS))}: one declared maximum ({MAX_PROMPT}) vs "
            "`dynamic=False`",
            "",
            "| family | variant | tokens identical (all prompts) | Dynamo graphs | XLA compiles | seconds |",
            "|---|---|---|---:|---:|---:|",
        ]
        for r in buck:
            for variant in ("buckets", "static"):
                v = r.get(variant)
                if v is None:
                    lines.append(f"| {r['name'][8:]} | {variant} | - | | | | {r.get('error', '')} |")
                    continue
                lines.append(
                    f"| {r['name'][8:]} | {variant} | {'yes' if v['tokens_identical'] else '**no**'} | "
                    f"{v['graphs']} | {v['xla_compiles']} | {v['seconds']} |"
                )
    lines += ["", "Not run (no `_can_compile_fullgraph`): " + ", ".join(excluded()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sweep_runner.main(
        script=__file__,
        title="static-cache generation",
        stem="generate",
        names=families() + [f"buckets/{f}" for f in BUCKET_FAMILIES],
        work=work,
        markdown=markdown,
        default_timeout=300,
        priority=PRIORITY,
    )

"""A fast subset of the architecture sweep (bench/sweep.py): a few types of each Transformers
auto-mapping, chosen for breadth, built tiny from their default configs exactly as the sweep
builds them, through backend="tpu" against eager (the sweep's tolerance: rtol 1e-4, atol 1e-4 x
the output's largest magnitude, over every floating output). The full sweep and its coverage
table are in bench/results/sweep.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import sweep  # noqa: E402

# (mapping, model type): why it is here.
SUBSET = [
    ("causal_lm", "deepseek_v3"),  # MoE (grouped routing, shared expert) and MLA attention
    ("causal_lm", "gemma2"),  # sliding and full attention layers, logit soft-capping
    ("masked_lm", "longformer"),  # as_strided chunks of views (lowered, not falling back)
    ("seq2seq_lm", "blenderbot"),  # encoder-decoder
    ("seq_cls", "bloom"),  # ALiBi attention, classifier on the last non-pad token
    ("image_cls", "dinov2"),  # ViT with interpolated position embeddings
    ("object_detection", "detr"),  # CNN backbone, transformer, box head
    ("semantic_seg", "segformer"),  # hierarchical vision transformer, upsampling head
    ("ctc", "wav2vec2"),  # raw audio: strided conv feature extractor, conv position embedding
    ("speech_seq2seq", "moonshine"),  # audio encoder-decoder
    ("causal_lm", "zamba2"),  # Mamba2 layers and a shared attention block (a per-family recipe)
    ("image_cls", "siglip2"),  # NaFlex patch inputs with spatial shapes (a per-family input recipe)
    ("image_cls", "pp_lcnet"),  # activations kept out of the denormals XLA flushes (its recipe)
]

# Ops an MoE's default experts implementation runs in PyTorch: transformers' own custom op
# (transformers::grouped_mm_fallback) and the sort/topk whose tie order only PyTorch's kernels
# give (see "Tie order" in docs/architecture.md). Results still match eager.
MOE_FALLBACKS = {"transformers.grouped_mm_fallback.default", "aten.sort.default", "aten.topk.default"}


@pytest.mark.parametrize("mapping,model_type", SUBSET, ids=[f"{m}/{t}" for m, t in SUBSET])
def test_sweep_subset_matches_eager(mapping, model_type):
    rec = sweep.run_type(mapping, model_type, backends=("tpu",))
    assert rec["eager_ok"], rec.get("error")
    assert rec["tpu_ok"], f"{rec.get('tpu_error')} (fallback ops: {rec.get('tpu_fallback_ops')})"
    allowed = MOE_FALLBACKS if model_type == "deepseek_v3" else set()
    assert set(rec["tpu_fallback_ops"]) <= allowed, "every other op of these types has a lowering rule"


def test_report_and_reference_backfill():
    """A reference-only rerun (`--aot-eager always` over a type an on-failure run left without its
    aot_eager result) keeps the record's tpuc result and adds aot_eager's; the report lists as
    failing in torch only the types where aot_eager ran and failed."""
    old = {"mapping": "ctc", "type": "a", "built": True, "eager_ok": True, "tpu_ok": True, "seconds": 3}
    new = {"mapping": "ctc", "type": "a", "built": True, "eager_ok": True, "aot_eager_ok": True, "seconds": 1}
    merged = sweep._merge(old, new, ("aot_eager",))
    assert merged["tpu_ok"] and merged["aot_eager_ok"] and merged["seconds"] == 3
    crashed = sweep._merge(old, {"built": False, "error": "timeout", "stage": "timeout"}, ("aot_eager",))
    assert crashed["tpu_ok"] and crashed["aot_eager_ok"] is False and "timeout" in crashed["aot_eager_error"]
    assert sweep._merge(old, new, ("aot_eager", "tpu")) is new  # a full run replaces the record
    torch_fails = dict(old, type="b", aot_eager_ok=False, aot_eager_error="boom")
    text = sweep.report({"ctc/a": old, "ctc/b": torch_fails})
    section = text.split("## Failing in torch itself")[1].split("##")[0]
    assert "ctc/b: boom" in section and "ctc/a" not in section

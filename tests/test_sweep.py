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
# give (see "Tie order" in the README). Results still match eager.
MOE_FALLBACKS = {"transformers.grouped_mm_fallback.default", "aten.sort.default", "aten.topk.default"}


@pytest.mark.parametrize("mapping,model_type", SUBSET, ids=[f"{m}/{t}" for m, t in SUBSET])
def test_sweep_subset_matches_eager(mapping, model_type):
    rec = sweep.run_type(mapping, model_type, backends=("tpu",))
    assert rec["eager_ok"], rec.get("error")
    assert rec["tpu_ok"], f"{rec.get('tpu_error')} (fallback ops: {rec.get('tpu_fallback_ops')})"
    allowed = MOE_FALLBACKS if model_type == "deepseek_v3" else set()
    assert set(rec["tpu_fallback_ops"]) <= allowed, "every other op of these types has a lowering rule"

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
    ("causal_lm", "qwen3_moe"),  # MoE: router topk, experts gathered per token
    ("causal_lm", "gemma3_text"),  # sliding and full attention layers, soft-capping
    ("masked_lm", "longformer"),  # as_strided chunks of views (lowered, not falling back)
    ("seq2seq_lm", "bart"),  # encoder-decoder
    ("seq_cls", "deberta-v2"),  # relative position attention, pooled classifier
    ("image_cls", "convnextv2"),  # CNN with depthwise convolutions and GRN
    ("semantic_seg", "segformer"),  # hierarchical vision transformer, upsampling head
    ("ctc", "wav2vec2"),  # raw audio: strided conv feature extractor, conv position embedding
    ("speech_seq2seq", "whisper"),  # log-mel features, encoder-decoder
]


@pytest.mark.parametrize("mapping,model_type", SUBSET, ids=[f"{m}/{t}" for m, t in SUBSET])
def test_sweep_subset_matches_eager(mapping, model_type):
    rec = sweep.run_type(mapping, model_type, backends=("tpu",))
    assert rec["eager_ok"], rec.get("error")
    assert rec["tpu_ok"], f"{rec.get('tpu_error')} (fallback ops: {rec.get('tpu_fallback_ops')})"
    assert rec["tpu_fallback_ops"] == {}, "every op of these types has a lowering rule"

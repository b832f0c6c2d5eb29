"""Architecture sweep: every model type of Transformers' auto-mappings, tiny and random, through
eager, `backend="aot_eager"` (what torch itself compiles) and `backend="tpu"`.

    python bench/sweep.py [--mapping causal_lm,...] [--types llama,...] [--limit N] [--jobs N]
                          [--rerun] [--timeout S] [--out bench/results/sweep.json]

Each type is built from its default config shrunk to a tiny size (`shrink`: hidden 64, 2 layers,
4 heads, vocab 512, images of 32-64 pixels, per-family fixes in `FAMILY`), with seeded random
weights, in eval mode, with `attn_implementation="sdpa"` where the class supports it (else eager).
Inputs are seeded token ids / pixel values / audio of a small size. Each type runs in its own
process (forked from a parent that has imported torch and transformers) under a timeout. A type
passes a backend when every floating output (logits, boxes, ...) is within rtol 1e-4 and atol
1e-4 x the output's largest magnitude of eager. Results accumulate in `--out` (types already
there are skipped unless `--rerun`; with `--aot-eager always`, a type that an `on-failure` run left
without its aot_eager result runs that backend alone, merged into its record), and a markdown
report is written next to it. Each invocation's command and wall time are kept in `_meta.runs`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from itertools import zip_longest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_history  # noqa: E402
import tiny  # noqa: E402

RESULTS = Path(__file__).parent / "results"
RTOL = 1e-4
ATOL_REL = 1e-4  # atol = ATOL_REL x the output's largest magnitude
SEED = 0
VOCAB = 512
SEQ = 8
BATCH = 2
HIDDEN = 64
LAYERS = 2
HEADS = 4
IMAGE = 32
MAX_PARAMS = 40_000_000  # a config the shrink missed: reported, not run for minutes

#: mapping name -> (transformers' NAMES dict in modeling_auto, the kind of inputs)
MAPPINGS = {
    "causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "text"),
    "masked_lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "text"),
    "seq2seq_lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
    "seq_cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text"),
    "image_cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image"),
    "object_detection": ("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES", "image"),
    "semantic_seg": ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "image"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "audio"),
    "speech_seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech_seq2seq"),
}

# ---------------------------------------------------------------------------------------------
# Shrinking configs

# Scalar config keys -> tiny values (set only where the default config has the key).
_WIDTH = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "n_embed": HIDDEN,
    "dim": HIDDEN,
    "emb_dim": HIDDEN,
    "pooler_hidden_size": HIDDEN,
    "model_dim": HIDDEN,
    "embedding_size": HIDDEN,
    "word_embed_proj_dim": HIDDEN,
    "projection_dim": HIDDEN,
    "encoder_hidden_size": HIDDEN,
    "decoder_hidden_size": HIDDEN,
    "text_hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "ffn_dim": 2 * HIDDEN,
    "encoder_ffn_dim": 2 * HIDDEN,
    "decoder_ffn_dim": 2 * HIDDEN,
    "decoder_intermediate_size": 2 * HIDDEN,
    "d_ff": 2 * HIDDEN,
    "d_inner": 2 * HIDDEN,
    "hidden_dim": 2 * HIDDEN,
    "n_inner": 2 * HIDDEN,
    "ffn_hidden_size": 2 * HIDDEN,
    "dense_intermediate_size": 2 * HIDDEN,
    "shared_intermediate_size": 2 * HIDDEN,
    "moe_intermediate_size": HIDDEN // 2,
    "expert_intermediate_size": HIDDEN // 2,
    "shared_expert_intermediate_size": HIDDEN,
    "d_kv": HIDDEN // HEADS,
    "head_dim": HIDDEN // HEADS,
    "kv_channels": HIDDEN // HEADS,
    "attention_head_size": HIDDEN // HEADS,
    "rotary_dim": 8,
    "rotary_emb_dim": 8,
    "linear_head_dim": HIDDEN // HEADS,
    "linear_key_head_dim": HIDDEN // HEADS,
    "linear_value_head_dim": HIDDEN // HEADS,
    "linear_num_heads": HEADS,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": HEADS,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
}
_DEPTH = {
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_layers": LAYERS,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "num_decoder_layers": LAYERS,
    "num_encoder_layers": LAYERS,
    "decoder_num_layers": LAYERS,
    "encoder_num_layers": LAYERS,
    "num_hidden_groups": 1,
}
_HEADS = {
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "decoder_num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "multi_query_group_num": 2,
    "num_key_value_groups": None,  # derived where present; left alone
}
_MOE = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "num_expert_group": 1,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}
_SSM = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_ssm": 128,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 8,
    "state_size": 16,
    "ssm_state_size": 16,
    "chunk_size": 8,
    "time_step_rank": 8,
    "n_groups": 1,
}
_MOE_UNSET = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "num_experts")
_SIZES = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_seq_len": 128,
    "seq_length": 128,
    "max_sequence_length": 128,
    "max_window_layers": LAYERS,
    "image_size": IMAGE,
    "num_labels": 3,
    "num_queries": 10,
    "entity_vocab_size": 64,
    "entity_emb_size": 32,
    "window_size": 4,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
}
# Set wherever the key exists (booleans and strings included).
_FORCE = {"use_timm_backbone": False, "use_pretrained_backbone": False}
_ZERO = tiny.DROPOUT_KEYS


# Per-stage lists of hierarchical vision models (ConvNeXt, Swin, PVT, Segformer ...).
_STAGE_WIDTHS = (
    "hidden_sizes",
    "embed_dims",
    "dims",
    "widths",
    "hidden_dims",
    "neck_hidden_sizes",
    "embed_dim",
)
_STAGE_DEPTHS = ("depths", "num_layers_per_stage", "stage_depths", "num_encoder_blocks")


# Models whose stage widths are tied to other lists the shrink does not know (kept as they are).
_KEEP_WIDTHS = ("hgnet_v2",)


def _int_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


def shrink_dict(d: dict, depth: int = 0) -> dict:
    """Tiny overrides for the config dict `d` (sub-configs shrunk recursively)."""
    out: dict = {}
    old_layers = None
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(d.get(key), int):
            old_layers = d[key]
            break
    for key, value in d.items():
        if isinstance(value, dict) and value.get("model_type") == "timm_backbone":
            out[key] = dict(_RESNET_BACKBONE)  # timm is not installed: a tiny Transformers ResNet
            idx = [i for i in value.get("out_indices") or [1, 2, 3, 4] if 1 <= i <= 4]
            out[key]["out_features"] = [f"stage{i}" for i in idx]
            out[key]["out_indices"] = idx
            continue
        if isinstance(value, dict) and depth < 3 and ("model_type" in value or key.endswith("config")):
            out[key] = shrink_dict(value, depth + 1)
            continue
        if key in _FORCE:
            out[key] = _FORCE[key]
            continue
        if isinstance(value, bool):
            continue
        table_value = None
        for table in (_WIDTH, _DEPTH, _HEADS, _MOE, _SSM, _SIZES):
            if key in table:
                table_value = table[key]
                break
        if key == "head_dim" and isinstance(d.get("qk_rope_head_dim"), int):
            table_value = _WIDTH["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
        if key == "vocab_size" and value is None:
            value = VOCAB  # left unset in the default (ESM): the tiny vocab
        if key in ("head_dim", "num_key_value_heads") and value is None and "num_attention_heads" in d:
            # Left unset by the default and not derived by every model (hunyuan, ministral,
            # nemotron): the tiny head size, and as many KV heads as heads (what unset means).
            out[key] = HIDDEN // HEADS if key == "head_dim" else HEADS
            continue
        if key in _MOE_UNSET and value is None and "moe_intermediate_size" in d:
            value = 1  # an MoE whose default leaves the expert counts unset (dots1, deepseek_v2)
        if table_value is not None and isinstance(value, int):
            if key in _MOE and value == 0:
                continue  # a dense model with an MoE field switched off
            if key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads") and value == d.get(
                "num_attention_heads", d.get("n_head", -1)
            ):
                table_value = HEADS  # multi-head (no grouping): stays multi-head
            if key in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k"):
                table_value = min(value, 2)
            out[key] = table_value
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and key in _WIDTH
            and old_layers is not None
            and len(value) == old_layers
        ):
            out[key] = [_WIDTH[key]] * LAYERS  # a per-layer width (gemma3n's intermediate sizes)
        elif (
            _int_list(value)
            and key in _STAGE_WIDTHS
            and depth == 0
            and d.get("model_type") not in _KEEP_WIDTHS
        ):
            # (top level only: a backbone's widths must stay those its neck was built for)
            out[key] = [16 * 2 ** min(i, 3) for i in range(len(value))]  # per-stage widths
        elif _int_list(value) and key in _STAGE_DEPTHS:
            out[key] = [1] * len(value)
        elif _int_list(value) and key in _HEADS and len(value) <= 6:
            out[key] = [2 ** min(i, 3) for i in range(len(value))]  # 16 per head, like the widths
        elif key in _ZERO and isinstance(value, float):
            out[key] = 0.0
        elif (
            isinstance(value, list)
            and old_layers is not None
            and len(value) == old_layers
            and old_layers > LAYERS
            and not key.endswith("token_id")
        ):
            out[key] = tiny.layer_list(value, LAYERS)
    picks = d.get("out_indices") or d.get("out_features")
    if isinstance(picks, list) and picks and "num_hidden_layers" in out:
        # A ViT-like backbone whose stages are its layers: as many layers as features read.
        k = len(picks)
        out["num_hidden_layers"] = max(LAYERS, k)
        if d.get("out_indices"):
            out["out_indices"] = list(range(1, k + 1))
        if d.get("out_features"):
            out["out_features"] = [f"stage{i}" for i in range(1, k + 1)]
    plc = d.get("per_layer_config")
    old_types, new_types = d.get("layer_types"), out.get("layer_types")
    if isinstance(plc, dict) and plc and isinstance(old_types, list) and isinstance(new_types, list):
        # Per-layer overrides keyed by layer index: each new layer takes those of the first old
        # layer of its type (shrunk like the config).
        width = len(str(next(iter(plc))))
        remapped = {}
        for j, t in enumerate(new_types):
            for i, old_t in enumerate(old_types):
                old_key = f"{i:0{width}d}"
                if old_t == t and old_key in plc:
                    layer = {**plc[old_key], **shrink_dict(plc[old_key], depth + 1)}
                    if "qk_nope_head_dim" in layer:  # an MLA layer: head_dim is nope + rope
                        layer["qk_rope_head_dim"] = _WIDTH["qk_rope_head_dim"]
                        layer["head_dim"] = layer["qk_nope_head_dim"] + layer["qk_rope_head_dim"]
                    remapped[f"{j:0{width}d}"] = layer
                    break
        out["per_layer_config"] = remapped
    return out


_RESNET_BACKBONE = {
    "model_type": "resnet",
    "embedding_size": 16,
    "hidden_sizes": [16, 32, 64, 128],
    "depths": [1, 1, 1, 1],
    "layer_type": "basic",
    "out_features": ["stage1", "stage2", "stage3", "stage4"],
}

# Tiny backbones for the PaddlePaddle OCR/layout detectors (their defaults are full size): four
# stages of 16-128 channels, each halving the resolution (the necks upsample by 2 between stages).
_HGNET_V2_BACKBONE = {
    "model_type": "hgnet_v2",
    "embedding_size": 16,
    "depths": [1, 1, 1, 1],
    "hidden_sizes": [16, 32, 64, 128],
    "stem_channels": [3, 8, 16],
    "stage_in_channels": [16, 16, 32, 64],
    "stage_mid_channels": [16, 16, 32, 64],
    "stage_out_channels": [16, 32, 64, 128],
    "stage_num_blocks": [1, 1, 1, 1],
    "stage_numb_of_layers": [1, 1, 1, 1],
    "out_features": ["stage1", "stage2", "stage3", "stage4"],
    "out_indices": [1, 2, 3, 4],
}
_LCNET_V4_BACKBONE = {
    "model_type": "pp_lcnet_v4",
    # kernel, in, out, stride, squeeze-excitation
    "block_configs": [
        [[3, 16, 16, 1, False]],
        [[3, 16, 32, 2, False]],
        [[3, 32, 64, 2, True]],
        [[3, 64, 128, 2, False]],
    ],
    "stem_channels": [3, 8, 16],
    "stage_out_channels": [16, 32, 64, 128],
    "depths": [1, 1, 1, 1],
    "out_features": ["stage1", "stage2", "stage3", "stage4"],
    "out_indices": [1, 2, 3, 4],
}


def _ocr_intraclass_blocks() -> dict:
    """The PP-OCR detectors' intra-class blocks: (kernel, stride, padding) of each convolution, with
    long/mid/short kernels of 7/5/3 in vertical, horizontal and square shapes (the default config
    leaves them to the checkpoint)."""
    out = {"reduce_channel": [1, 1, 0], "return_channel": [1, 1, 0]}
    for ratio, k in (("longratio", 7), ("midratio", 5), ("shortratio", 3)):
        out[f"vertical_long_to_small_conv_{ratio}"] = [[k, 1], [1, 1], [k // 2, 0]]
        out[f"horizontal_small_to_long_conv_{ratio}"] = [[1, k], [1, 1], [0, k // 2]]
        out[f"symmetric_conv_long_{ratio}"] = [[k, k], [1, 1], [k // 2, k // 2]]
    return out


_OCR_DET = {
    "neck_out_channels": 32,
    "intraclass_block_config": _ocr_intraclass_blocks(),
    "scale_factor_list": [1, 2, 4, 8],
    "kernel_list": [3, 2, 2],
}

# Qwen4-exp's indexed-attention layers' indexer (left to the checkpoint by the default).
_QSA_INDEXER = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
}

# Per-family overrides applied on top of `shrink_dict` (keys of the top-level config).
FAMILY: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},
    # Group norms of 32 groups over the shrunk stage widths (16-128; a bottleneck's inner width
    # is a quarter of that): 4 groups divide them all.
    "bit": {"num_groups": 4},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    "gemma3n_text": {
        "num_kv_shared_layers": 0,
        "laurel_rank": 8,
    },
    "dpt": {"num_hidden_layers": 4, "backbone_out_indices": [0, 1, 2, 3], "fusion_hidden_size": 32},
    # Swin-like: two stages of windows of 4 over 16x16 patches (as tests/zoo.py's swin).
    "swin": {"embed_dim": 32, "depths": [1, 1], "num_heads": [2, 4], "patch_size": 2},
    "swinv2": {"embed_dim": 32, "depths": [1, 1], "num_heads": [2, 4], "patch_size": 2},
    # Semantic segmentation reads 4 layers' features (out_indices): 4 layers.
    "beit": {
        "num_hidden_layers": 4,
        "out_indices": [1, 2, 3, 4],
        "out_features": [f"stage{i}" for i in range(1, 5)],
    },
    "data2vec-vision": {
        "image_size": 64,  # segmentation reshapes patches by the configured size: that of the inputs
        "num_hidden_layers": 4,
        "out_indices": [1, 2, 3, 4],
        "out_features": [f"stage{i}" for i in range(1, 5)],
    },
    "donut-swin": {"embed_dim": 32, "depths": [1, 1], "num_heads": [2, 4], "patch_size": 2},
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320},
    "mobilevitv2": {"image_size": 64},  # 32 px: the last stage's 2 x 2 patches see 1 x 1
    "textnet": {"stem_out_channels": 16, "image_size": [64, 64]},  # the stem feeds stage 1 (16 wide)
    "perceiver": {
        "d_latents": HIDDEN,
        "num_latents": 16,
        "num_self_attends_per_block": LAYERS,
        "num_self_attention_heads": HEADS,
        "num_cross_attention_heads": 1,
        "_label_trainable_num_channels": HIDDEN,
        "output_num_channels": HIDDEN,
    },
    "siglip2": {"vision_config": {"patch_size": 4, "num_patches": 64}},
    "shieldgemma2": {
        "mm_tokens_per_image": 4,
        "vision_config": {"image_size": 32, "patch_size": 8},
        "yes_token_index": 10,
        "no_token_index": 11,
    },
    "pp_ocrv5_server_det": {**_OCR_DET, "backbone_config": _HGNET_V2_BACKBONE},
    "pp_ocrv6_medium_det": {**_OCR_DET, "backbone_config": _LCNET_V4_BACKBONE},
    "pp_ocrv6_small_det": {
        "backbone_config": _LCNET_V4_BACKBONE,
        "neck_out_channels": 32,
        "layer_list_out_channels": [16, 32, 64, 128],
    },
    "pp_doclayout_v2": {
        "backbone_config": {
            **_HGNET_V2_BACKBONE,
            "out_features": ["stage2", "stage3", "stage4"],
            "out_indices": [2, 3, 4],
        },
        "encoder_in_channels": [32, 64, 128],
        "class_thresholds": [0.5] * 3,  # per label (3 once shrunk); the defaults leave them unset
        "class_order": [0, 1, 2],
    },
    "lw_detr": {
        "projector_scale_factors": [1.0],  # the default has none: no feature level at all
        "num_feature_levels": 1,
        "projector_in_channels": [HIDDEN],
        "backbone_config": {"num_windows": 4},
    },
    "sapiens2": {
        "num_key_value_heads_per_layer": [HEADS, 2],
        "num_first_full_attention_layers": 1,
        "num_last_full_attention_layers": 0,
        "num_key_value_attention_heads": 2,
        "head_config": {  # left to the checkpoint by the default: two 2x upsamplings, one 1x1 conv
            "upsample_out_channels": [32, 16],
            "upsample_kernel_sizes": [4, 4],
            "use_pixel_shuffle": False,
            "conv_out_channels": [16],
            "conv_kernel_sizes": [1],
        },
    },
    # Audio tokenizers whose channels double at each of 6 downsamplings: 2 filters at the start.
    "vibevoice_asr": {
        "acoustic_tokenizer_encoder_config": {"num_filters": 2},
        "semantic_tokenizer_encoder_config": {"num_filters": 2},
    },
    "vibevoice": {"audio_config": {"num_filters": 2}, "semantic_model_config": {"num_filters": 2}},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": HIDDEN // 4}},  # validated: text hidden / 4
    "moonshine_streaming": {"num_key_value_heads": HEADS},
    "kyutai_speech_to_text": {
        "num_codebooks": 4,
        "codebook_vocab_size": 64,
        "codec_config": {"upsample_groups": HIDDEN, "num_filters": 8, "num_quantizers": 4},
    },
    "dia": {  # cross-attention to the encoder: its own widths
        "decoder_config": {
            "cross_hidden_size": HIDDEN,
            "cross_num_attention_heads": HEADS,
            "cross_num_key_value_heads": HEADS,
            "cross_head_dim": HIDDEN // HEADS,
        }
    },
    # Hybrids whose attention layers are placed by a period/offset or a list: one of each kind.
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_dt_rank": 8,
    },
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # default: no attention
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 8},
    "mamba2": {"num_heads": 8},  # num_heads x head_dim = expand x hidden
    "zamba": {
        "attention_hidden_size": 2 * HIDDEN,  # attention over [hidden, original embeddings]
        "attention_head_dim": 2 * HIDDEN // HEADS,
        "mamba_dt_rank": 8,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "num_hidden_layers": 3,  # two hybrid layers share one transformer (tied weights)
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    "zamba2": {
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
        "mamba_headdim": 16,
        "n_mamba_heads": 8,
        "hybrid_layer_ids": [1],
        "layers_block_type": ["linear_attention", "hybrid"],
    },
    "rwkv": {"attention_hidden_size": HIDDEN, "context_length": 128},
    "xlstm": {"embedding_dim": HIDDEN, "num_blocks": LAYERS, "chunk_size": SEQ, "qk_dim_factor": 1.0},
    # One layer per stack; the cache holds one slot per layer and cycle: 1 x H 2 x (L 1 + 1).
    "hrm_text": {
        "num_layers_per_stack": 1,
        "H_cycles": 2,
        "L_cycles": 1,
        "L_bp_cycles": [1],
        "num_hidden_layers": 4,
    },
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    "qwen4_exp_text": _QSA_INDEXER,
    "qwen4_exp": {"text_config": _QSA_INDEXER},
    "xmod": {"default_language": "en_XX"},  # its adapters are per language
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [8, 16],  # product: max_position_embeddings
        "axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2],  # sum: hidden_size
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 2,
        "feed_forward_size": 2 * HIDDEN,
    },
    "causal_lm/reformer": {"is_decoder": True},  # (its masked LM requires is_decoder=False)
    "layoutlmv3": {"coordinate_size": 11, "shape_size": 10},  # 4 x coordinate + 2 x shape = hidden
    "lilt": {"hidden_size": 96, "intermediate_size": 192},  # six layout embeddings of hidden / 6
    "dbrx": {"attn_config": {"rope_theta": 1e4, "clip_qkv": 8.0}},  # read by the attention, unset by default
    # MLA whose rotary part is half of head_dim (partial_rotary_factor 0.5): 8 + 8.
    "mistral4": {"head_dim": 16, "qk_head_dim": 16, "qk_nope_head_dim": 8},
    # No init of its own: the default N(0, 0.02) shrinks activations ~1e5x per stage, to ~1e-35 at
    # the output, through float32's denormal range, which XLA's CPU code flushes to zero (FTZ/DAZ):
    # a weight scale that keeps them O(1), as trained weights do.
    "pp_lcnet": {"initializer_range": 0.3},
    "blt": {  # byte-group hash embeddings (500k rows) and the global model's width
        "encoder_hash_byte_group_vocab": 1024,
        "encoder_config": {"hidden_size_global": HIDDEN},
        "decoder_config": {"hidden_size_global": HIDDEN},
    },
    "kolibri1_1": {  # indexer: at most the query heads of one KV head; lists derived from the layers
        "index_num_heads": 2,
        "index_topk": 4,
        "index_pool_size": 16,
        "index_compression": 2,
        "index_num_local_tokens": 2,
        "index_num_sink_tokens": 1,
        "index_layers": None,
        "kv_source_layers": None,
        "mlp_only_layers": None,
    },
    # A draft model sharing all its KV with the target's: no per-layer inputs (validated).
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": LAYERS,
            "num_hidden_layers": LAYERS,
        }
    },
    "dots3_note": {  # adapters from each encoder: in = its hidden size
        "vision_config": {"adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN},
        "audio_config": {"adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN},
    },
    "dory": {
        "layer_types": None,
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_output_layers": 1,
        "n_recurrent_layers": None,
    },
}


def _deep_update(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def _fix_token_ids(cfg, vocab: int) -> None:
    """Special token ids of the default config that the small vocab no longer has -> small ids."""
    for obj in [cfg] + [getattr(cfg, k) for k in _sub_config_keys(cfg)]:
        v = getattr(obj, "vocab_size", None) or vocab
        for name, val in list(vars(obj).items()):  # (vars: a per-layer attribute's getattr raises)
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(val, int):
                setattr(obj, name, tiny.fix_token_id(val, v, name))
            elif name.endswith("_token_id") and isinstance(val, list):
                setattr(obj, name, [x if x < v else v - 1 for x in val])


def _text_config(cfg):
    """The config's text (decoder) config, or the config itself where it has none or several."""
    try:
        return cfg.get_text_config(decoder=True)
    except Exception:
        return cfg


def _sub_config_keys(cfg) -> list[str]:
    from transformers import PretrainedConfig

    return [k for k, v in vars(cfg).items() if isinstance(v, PretrainedConfig)]


def make_config(model_type: str, mapping: str = ""):
    """The tiny config: `shrink_dict` over the default, then FAMILY[model_type], then
    FAMILY["mapping/model_type"] (what one mapping's class needs)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception:
        # A default its own validation rejects (gemma4_assistant): the family's fixes make it one.
        default = cls(**copy.deepcopy(FAMILY.get(model_type, {})))
    d = default.to_dict()
    over = shrink_dict(d)
    _deep_update(over, copy.deepcopy(FAMILY.get(model_type, {})))
    _deep_update(over, copy.deepcopy(FAMILY.get(f"{mapping}/{model_type}", {})))
    merged = _deep_update(copy.deepcopy(d), over)
    merged.pop("model_type", None)
    for k in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"):
        merged.pop(k, None)
    try:
        cfg = cls(**merged)
    except Exception:
        # Some configs do not take their own to_dict() back (derived fields, sub-config
        # classes): the overrides alone, over the class's defaults.
        over.pop("model_type", None)
        cfg = cls(**over)
    _fix_token_ids(cfg, VOCAB)
    text = _text_config(cfg)
    for c in {id(cfg): cfg, id(text): text}.values():
        if getattr(c, "pad_token_id", None) is None:
            try:
                c.pad_token_id = 0  # batched classifiers find the last token by the pad id
            except Exception:
                pass
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = 0
    return cfg


# ---------------------------------------------------------------------------------------------
# Building models and inputs


def _model_class(mapping: str, model_type: str):
    import transformers
    import transformers.models.auto.modeling_auto as auto

    names = getattr(auto, MAPPINGS[mapping][0])[model_type]
    if isinstance(names, tuple | list):
        names = names[0]
    return getattr(transformers, names)


def _set_attn(cfg, impl: str) -> None:
    cfg._attn_implementation = impl
    for k in _sub_config_keys(cfg):
        try:
            getattr(cfg, k)._attn_implementation = impl
        except Exception:
            pass


def config_for(mapping: str, model_type: str):
    """The tiny config that the mapping's class for `model_type` takes: `make_config`'s, or for a
    multimodal type mapped to its text model's class (qwen3_5 -> Qwen3_5ForCausalLM, musicgen ->
    MusicgenForCausalLM) the sub-config of that class."""
    cls = _model_class(mapping, model_type)
    cfg = make_config(model_type, mapping)
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(cfg, want):
        subs = [getattr(cfg, k) for k in _sub_config_keys(cfg)] + [_text_config(cfg)]
        cfg = next((c for c in subs if isinstance(c, want)), cfg)
    return cfg


def build(mapping: str, model_type: str):
    """`(model, kwargs)`: the tiny model in eval mode and its inputs."""
    torch.manual_seed(SEED)
    cls = _model_class(mapping, model_type)
    cfg = config_for(mapping, model_type)
    impl = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    _set_attn(cfg, impl)
    try:
        model = cls(cfg)
    except (ValueError, ImportError) as e:
        if impl != "sdpa" or not any(w in str(e).lower() for w in ("sdpa", "attention implementation")):
            raise
        impl = "eager"
        _set_attn(cfg, impl)
        model = cls(cfg)
    model.eval()
    inputs = make_inputs(mapping, model, cfg)
    return model, inputs, impl


def _text_ids(cfg, seq=SEQ, batch=BATCH):
    g = torch.Generator().manual_seed(SEED + 1)
    vocab = getattr(cfg, "vocab_size", None) or getattr(
        getattr(cfg, "text_config", None), "vocab_size", VOCAB
    )
    # Avoid the low ids (pad/bos/eos and other special tokens) and the top ones.
    hi = max(vocab - 16, 8)
    return torch.randint(4, hi, (batch, seq), generator=g)


def _image_size(cfg) -> tuple[int, int]:
    for c in [cfg, getattr(cfg, "vision_config", None), getattr(cfg, "backbone_config", None)]:
        if c is None:
            continue
        s = getattr(c, "image_size", None)
        if isinstance(s, int):
            return s, s
        if isinstance(s, list | tuple) and len(s) == 2:
            return int(s[0]), int(s[1])
    return IMAGE, IMAGE


def _num_channels(cfg) -> int:
    for c in [cfg, getattr(cfg, "vision_config", None), getattr(cfg, "backbone_config", None)]:
        n = getattr(c, "num_channels", None) if c is not None else None
        if isinstance(n, int):
            return n
    return 3


def _siglip2_inputs(cfg, g) -> dict:
    """NaFlex patches: (batch, patches, channels x patch x patch), a 4 x 4 grid per image."""
    v = cfg.vision_config
    dim = v.num_channels * v.patch_size**2
    return {
        "pixel_values": torch.randn(BATCH, 16, dim, generator=g),
        "pixel_attention_mask": torch.ones(BATCH, 16, dtype=torch.long),
        "spatial_shapes": torch.tensor([[4, 4]] * BATCH),
    }


def _image_text_inputs(cfg, g) -> dict:
    """A VLM read as a classifier: its image tokens (mm_tokens_per_image of them) in the text."""
    n = cfg.mm_tokens_per_image
    ids = _text_ids(cfg.text_config, seq=SEQ + n)
    ids[:, 2 : 2 + n] = cfg.image_token_index
    v = cfg.vision_config
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(BATCH, v.num_channels, v.image_size, v.image_size, generator=g),
    }


def _dia_inputs(cfg, g) -> dict:
    """Text in, and the decoder's audio codes: one token per codebook channel at every step."""
    dec = cfg.decoder_config
    codes = torch.randint(4, dec.vocab_size - 16, (BATCH, SEQ // 2, dec.num_channels), generator=g)
    return {"input_ids": _text_ids(cfg.encoder_config), "decoder_input_ids": codes}


def _realtime_audio_inputs(cfg, g) -> dict:
    """Streaming ASR: every text token comes with `audio_length_per_tok` mel frames."""
    bins = cfg.audio_config.num_mel_bins
    frames = SEQ * cfg.audio_length_per_tok
    return {
        "input_ids": _text_ids(cfg.text_config),
        "input_features": torch.randn(BATCH, bins, frames, generator=g),
    }


def _text_and_codes_inputs(cfg, g) -> dict:
    """Kyutai STT: at every step a text token and one code per audio codebook."""
    ids = torch.randint(4, cfg.codebook_vocab_size - 4, (BATCH, SEQ, 1 + cfg.num_codebooks), generator=g)
    return {"input_ids": ids}


def _codebook_rows_inputs(cfg, g) -> dict:
    """MusicGen's decoder: one row of codes per (batch, codebook)."""
    return {"input_ids": _text_ids(cfg, batch=BATCH * cfg.num_codebooks)}


#: model type -> inputs (cfg, generator) -> dict, where the mapping's generic inputs do not fit.
INPUTS = {
    # Its forward builds a DynamicCache from the top config, which has no layer count of its own.
    "blt": lambda cfg, g: {"input_ids": _text_ids(cfg), "use_cache": False},
    "musicgen_decoder": _codebook_rows_inputs,
    "musicgen_melody_decoder": _codebook_rows_inputs,
    "kyutai_speech_to_text": _text_and_codes_inputs,
    "dia": _dia_inputs,
    "voxtral_realtime": _realtime_audio_inputs,
    "siglip2": _siglip2_inputs,
    "shieldgemma2": _image_text_inputs,
}


def make_inputs(mapping: str, model, cfg) -> dict:
    kind = MAPPINGS[mapping][1]
    g = torch.Generator().manual_seed(SEED + 2)
    name = getattr(model, "main_input_name", "input_ids")
    if cfg.model_type in INPUTS:
        return INPUTS[cfg.model_type](cfg, g)
    if kind == "image" and name == "input_ids":  # ImageGPT: pixels as color-cluster tokens
        return {"input_ids": _text_ids(cfg)}
    if kind == "text":
        ids = _text_ids(cfg)
        eos = getattr(cfg, "eos_token_id", None)
        if mapping == "seq_cls" and getattr(cfg, "is_encoder_decoder", False) and isinstance(eos, int):
            ids[:, -1] = eos  # encoder-decoder classifiers read the hidden state at <eos>
        out = {"input_ids": ids}
        if name != "input_ids":
            out = {name: ids}
        return out
    if kind == "seq2seq":
        return {
            name: _text_ids(cfg),
            "decoder_input_ids": _text_ids(cfg, seq=SEQ // 2),
        }
    if kind == "image":
        h, w = _image_size(cfg) if mapping == "image_cls" else (64, 64)
        return {"pixel_values": torch.randn(BATCH, _num_channels(cfg), h, w, generator=g)}
    if kind == "audio":
        if name == "input_features":
            bins = _mel_bins(cfg)
            return {name: torch.randn(BATCH, 64, bins, generator=g)}
        if cfg.model_type in ("omniasr_ctc",):  # raw audio with a channel dim: (batch, 1, samples)
            return {name: torch.randn(BATCH, 1, 2000, generator=g)}
        return {name: torch.randn(BATCH, 2000, generator=g)}
    if kind == "speech_seq2seq" and name == "input_ids":
        # An audio LLM (voxtral, qwen3_asr, granite_speech ...): its text path, without audio.
        out = {"input_ids": _text_ids(cfg)}
        if getattr(cfg, "is_encoder_decoder", False):
            out["decoder_input_ids"] = _text_ids(cfg, seq=SEQ // 2)
        return out
    if kind == "speech_seq2seq":
        dec = _text_ids(cfg, seq=SEQ // 2)
        if name in ("input_values", "inputs"):  # raw audio (speech-encoder-decoder: a wav2vec2 encoder)
            return {name: torch.randn(BATCH, 2000, generator=g), "decoder_input_ids": dec}
        bins = _mel_bins(cfg)
        frames = _frames(cfg)
        shape = (BATCH, bins, frames) if _channels_first_features(cfg) else (BATCH, frames, bins)
        return {name: torch.randn(*shape, generator=g), "decoder_input_ids": dec}
    raise ValueError(kind)


# Models that read several mel frames stacked as one feature vector.
_STACKED_FRAMES = {"granite_speech5_ctc": 4}


def _mel_bins(cfg) -> int:
    keys = (
        "feature_projection_input_dim",
        "num_mel_bins",
        "feature_size",
        "input_feat_per_channel",
        "n_mels",
    )
    for key in keys:
        for c in [cfg, getattr(cfg, "encoder_config", None), getattr(cfg, "audio_config", None)]:
            v = getattr(c, key, None) if c is not None else None
            if isinstance(v, int) and v > 1:
                return v * getattr(cfg, "input_channels", 1) * _STACKED_FRAMES.get(cfg.model_type, 1)
    return 80


def _frames(cfg) -> int:
    if cfg.model_type in ("whisper",):
        return 2 * cfg.max_source_positions
    return 64


def _channels_first_features(cfg) -> bool:
    return cfg.model_type in ("whisper", "moonshine", "kyutai_speech_to_text")


# ---------------------------------------------------------------------------------------------
# Running and comparing


def _floats(out) -> list[torch.Tensor]:
    """Every floating tensor of a model's output, in order (ModelOutput, tuples, dicts)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, list | tuple):
        return [t for o in out for t in _floats(o)]
    return []


def compare(actual, expected) -> tuple[bool, float]:
    """(within tolerance, max abs error) over every floating output.

    Each output passes where |actual - expected| <= atol + RTOL x |expected|, with atol = ATOL_REL x
    the output's largest magnitude, and never below float32's smallest normal number (1.18e-38):
    a difference of a denormal counts as zero. XLA's CPU code runs with flush-to-zero and
    denormals-are-zero (documented XLA behaviour); PyTorch's kernels keep denormals. Outputs that
    are themselves computed through the denormal range are not comparable at all (eager with
    `torch.set_flush_denormal(True)` differs from eager there too): the recipes keep activations
    in the normal range instead (pp_lcnet's initializer_range)."""
    a, e = _floats(actual), _floats(expected)
    if len(a) != len(e) or not e:
        return False, float("inf")
    ok, worst = True, 0.0
    for x, y in zip(a, e, strict=True):
        if x.shape != y.shape:
            return False, float("inf")
        x, y = x.detach().double(), y.detach().double()
        scale = y.abs().nan_to_num(0.0).max().item() if y.numel() else 0.0
        err = (x - y).abs().nan_to_num(float("inf"), posinf=float("inf"))
        both_nan = x.isnan() & y.isnan()
        err = torch.where(both_nan, torch.zeros_like(err), err)
        worst = max(worst, err.max().item() if err.numel() else 0.0)
        atol = max(ATOL_REL * scale, torch.finfo(torch.float32).tiny)
        if not bool((err <= atol + RTOL * y.abs().nan_to_num(0.0)).all()):
            ok = False
    return ok, worst


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:300]


def _call(model, inputs):
    kwargs = dict(inputs)
    kwargs["return_dict"] = False
    return model(**kwargs)


def run_type(mapping: str, model_type: str, backends=("aot_eager", "tpu")) -> dict:
    """Builds, runs eager and each backend; returns the result record (no exceptions)."""
    import tpuc

    rec: dict = {"mapping": mapping, "type": model_type, "built": False, "eager_ok": False}
    t0 = time.time()
    try:
        model, inputs, impl = build(mapping, model_type)
        rec["built"] = True
        rec["class"] = type(model).__name__
        rec["attn"] = impl
        rec["params"] = sum(p.numel() for p in model.parameters())
        if rec["params"] > MAX_PARAMS:
            raise RuntimeError(f"not shrunk: {rec['params'] / 1e6:.0f}M parameters")
        with torch.no_grad():
            expected = _call(model, inputs)
            again = _call(model, inputs)
        if not _floats(expected):
            raise RuntimeError("no floating outputs")
        rec["eager_ok"] = True
        rec["eager_deterministic"] = compare(again, expected)[0]
    except Exception as e:
        rec["error"] = _short(e)
        rec["stage"] = "build" if not rec["built"] else "eager"
        rec["seconds"] = round(time.time() - t0, 2)
        return rec
    for backend in backends:
        if backend == "aot_eager?":  # the reference only where tpuc did not pass
            if rec.get("tpu_ok"):
                continue
            backend = "aot_eager"
        torch._dynamo.reset()
        tpuc.reset_stats()
        t1 = time.time()
        try:
            opts = {"options": {"fallback": "eager"}} if backend == "tpu" else {}
            compiled = torch.compile(model, backend=backend, dynamic=False, **opts)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                actual = _call(compiled, inputs)
            ok, err = compare(actual, expected)
            rec[f"{backend}_ok"] = ok
            rec[f"{backend}_max_err"] = err
            if not ok:
                rec[f"{backend}_error"] = f"mismatch: max abs err {err:.3g}"
        except Exception as e:
            rec[f"{backend}_ok"] = False
            rec[f"{backend}_error"] = _short(e)
        rec[f"{backend}_seconds"] = round(time.time() - t1, 2)
        if backend == "tpu":
            s = tpuc.stats()
            rec["tpu_fallback_ops"] = dict(s.get("fallback_ops", {}))
            rec["tpu_graphs"] = s.get("graphs_compiled")
            rec["tpu_eager_reruns"] = s.get("eager_reruns", 0)
    torch._dynamo.reset()
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def _child(mapping, model_type, backends, conn):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        rec = run_type(mapping, model_type, backends)
    except BaseException as e:  # noqa: BLE001 - the record says what happened
        rec = {"mapping": mapping, "type": model_type, "built": False, "error": _short(e), "stage": "crash"}
        rec["traceback"] = traceback.format_exc()[-2000:]
    conn.send(rec)
    conn.close()


def types_of(mapping: str) -> list[str]:
    import transformers.models.auto.modeling_auto as auto

    return list(getattr(auto, MAPPINGS[mapping][0]))


def key(mapping: str, model_type: str) -> str:
    return f"{mapping}/{model_type}"


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process `pid` so far: the timeout counts work, not the time a
    shared machine keeps the process waiting or stopped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# Keys a reference-only rerun (`--aot-eager always` over a type that already has its tpuc result)
# takes from the new record; the rest of the old record (build, eager, tpuc) is kept.
_AOT_KEYS = ("aot_eager_ok", "aot_eager_max_err", "aot_eager_error", "aot_eager_seconds")


def _merge(old: dict | None, rec: dict, backends) -> dict:
    """The record to keep: `rec`, or for a reference-only rerun the old record plus its result."""
    if old is None or tuple(backends) != ("aot_eager",):
        return rec
    merged = dict(old)
    for k in _AOT_KEYS:
        merged.pop(k, None)
    if rec.get("eager_ok"):
        merged.update({k: rec[k] for k in _AOT_KEYS if k in rec})
    else:  # the rerun did not get as far as aot_eager (timeout, crash): say so, keep the rest
        merged["aot_eager_ok"] = False
        merged["aot_eager_error"] = f"rerun for aot_eager: {rec.get('stage')}: {rec.get('error', '?')}"
    return merged


def _run_jobs(todo, jobs, timeout, results, out_path):
    """`todo`: (mapping, model type, backends) triples."""
    ctx = mp.get_context("fork")
    running: dict = {}
    queue = list(todo)
    done = 0
    while queue or running:
        while queue and len(running) < jobs:
            mapping, model_type, backends = queue.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(mapping, model_type, backends, child), daemon=True)
            p.start()
            child.close()
            running[p] = (mapping, model_type, backends, parent, time.time())
        time.sleep(0.2)
        for p, (mapping, model_type, backends, conn, started) in list(running.items()):
            rec = None
            if conn.poll():
                try:
                    rec = conn.recv()
                except EOFError:
                    rec = None
                p.join(10)
            elif not p.is_alive():
                rec = {"error": f"process died (exit code {p.exitcode})", "stage": "crash"}
            elif _cpu_seconds(p.pid) > timeout or time.time() - started > 4 * timeout:
                p.kill()
                p.join(10)
                rec = {"error": f"timeout after {timeout} s of CPU time", "stage": "timeout"}
            else:
                continue
            if p.is_alive():
                p.kill()
                p.join(10)
            rec = {"mapping": mapping, "type": model_type, "built": False, **rec}
            rec.setdefault("seconds", round(time.time() - started, 2))
            rec["wall_seconds"] = round(time.time() - started, 2)
            rec = _merge(results.get(key(mapping, model_type)), rec, backends)
            results[key(mapping, model_type)] = rec
            del running[p]
            done += 1
            if tuple(backends) == ("aot_eager",):
                status = (
                    "aot_eager ok" if rec.get("aot_eager_ok") else f"aot_eager: {rec.get('aot_eager_error')}"
                )
            else:
                status = "tpu ok" if rec.get("tpu_ok") else rec.get("tpu_error") or rec.get("error", "")
            print(f"[{done}/{len(todo)}] {mapping}/{model_type}: {str(status)[:120]}", flush=True)
            if done % 5 == 0:
                save(results, out_path)
    save(results, out_path)


def save(results: dict, out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(results.items())), indent=1, default=str) + "\n")
    tmp.replace(out_path)
    results_history.write_markdown(out_path.with_suffix(".md"), report(results))


# Types that cannot run as the sweep runs them, and why (the report says so next to their error).
NOT_STANDALONE = {
    "gemma4_assistant": "a draft model: its forward takes the target model's embeddings and shared KV "
    "states, not tokens",
    "gemma4_unified_assistant": "a draft model: its forward takes the target model's embeddings and "
    "shared KV states, not tokens",
}


def _missing_package(error: str) -> str | None:
    """The package a Transformers import error asks for ("requires the timm library")."""
    import re

    m = re.search(r"requires the (\w+) library", error)
    return m.group(1) if m else None


def _reason(rec: dict) -> str:
    if rec.get("type") in NOT_STANDALONE:
        return f"not standalone ({NOT_STANDALONE[rec['type']]})"
    pkg = _missing_package(rec.get("error", ""))
    if pkg:
        return f"needs the `{pkg}` package, not installed here"
    if not rec.get("built"):
        return f"build: {rec.get('error', '?')}"
    if not rec.get("eager_ok"):
        return f"eager: {rec.get('error', '?')}"
    return ""


def report(results: dict) -> str:
    meta = results.get("_meta", {})
    recs = [r for k, r in results.items() if not k.startswith("_")]
    lines = ["# Architecture sweep (Transformers auto-mappings)", ""]
    lines.append(
        "Generated by `bench/sweep.py`: every type of each mapping, tiny (hidden 64, 2 layers, "
        "4 heads, vocab 512, images 32 px), random weights, compared with eager (rtol 1e-4, "
        "atol 1e-4 x max |output|, never below float32's smallest normal 1.18e-38: XLA's CPU "
        "code flushes denormals to zero). `aot_eager` is what torch itself compiles; `tpuc` is "
        '`backend="tpu"` with `fallback="eager"`.'
    )
    if meta:
        lines += [
            "",
            f"torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}. Runs:",
            "",
        ]
        for run in meta.get("runs", []):
            lines.append(
                f"- {run.get('when', '?')}: `{run.get('command', '')}`, {run.get('types_run', '?')} types, "
                f"wall time {run.get('wall_seconds', '?')} s"
            )
    lines += [
        "",
        "| mapping | types | swept | built + eager ok | built % | tpuc pass | aot_eager run | aot_eager pass "
        "| tpuc fails, aot_eager passes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tot = [0] * 8
    for mapping in MAPPINGS:
        rs = [r for r in recs if r.get("mapping") == mapping]
        if not rs:
            continue
        try:
            n = len(types_of(mapping))
        except Exception:  # noqa: BLE001 - a report without transformers: the swept ones
            n = len(rs)
        row = [
            n,
            len(rs),
            sum(1 for r in rs if r.get("eager_ok")),
            0,
            sum(1 for r in rs if r.get("tpu_ok")),
            sum(1 for r in rs if "aot_eager_ok" in r),
            sum(1 for r in rs if r.get("aot_eager_ok")),
            sum(1 for r in rs if r.get("aot_eager_ok") and not r.get("tpu_ok")),
        ]
        tot = [a + b for a, b in zip(tot, row, strict=True)]
        cells = [str(x) for x in row]
        cells[3] = f"{100 * row[2] / max(n, 1):.0f}%"
        lines.append(f"| {mapping} | " + " | ".join(cells) + " |")
    tot_cells = [str(x) for x in tot]
    tot_cells[3] = f"{100 * tot[2] / max(tot[0], 1):.0f}%"
    lines.append("| **all** | " + " | ".join(f"**{x}**" for x in tot_cells) + " |")
    lines += [
        "",
        "aot_eager runs on every type with `--aot-eager always` and only where tpuc does not pass with "
        "`--aot-eager on-failure` (a type tpuc passes went through the same Dynamo and AOTAutograd graph).",
    ]
    lines += ["", "## tpuc failures where aot_eager passes", ""]
    n_section = len(lines)
    for r in sorted(recs, key=lambda r: (r["mapping"], r["type"])):
        if r.get("aot_eager_ok") and not r.get("tpu_ok"):
            fb = r.get("tpu_fallback_ops") or {}
            fbs = f" (fallback: {', '.join(f'{k} x{v}' for k, v in fb.items())})" if fb else ""
            lines.append(f"- {r['mapping']}/{r['type']}: {r.get('tpu_error', '?')}{fbs}")
    if len(lines) == n_section:
        lines.append("(none)")
    lines += ["", "## Failing in torch itself (aot_eager fails or mismatches; tpuc result in brackets)", ""]
    n_section = len(lines)
    for r in sorted(recs, key=lambda r: (r["mapping"], r["type"])):
        if r.get("eager_ok") and "aot_eager_ok" in r and not r["aot_eager_ok"]:
            tpu = "tpuc ok" if r.get("tpu_ok") else f"tpuc: {r.get('tpu_error', '?')[:100]}"
            lines.append(f"- {r['mapping']}/{r['type']}: {r.get('aot_eager_error', '?')[:200]} [{tpu}]")
    if len(lines) == n_section:
        lines.append("(none)")
    lines += ["", "## Not built / eager fails", ""]
    for r in sorted(recs, key=lambda r: (r["mapping"], r["type"])):
        if not r.get("eager_ok"):
            lines.append(f"- {r['mapping']}/{r['type']}: {_reason(r)[:250]}")
    lines += ["", "## Types that ran with ops falling back to eager", ""]
    for r in sorted(recs, key=lambda r: (r["mapping"], r["type"])):
        fb = r.get("tpu_fallback_ops") or {}
        if fb:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(fb.items()))
            lines.append(f"- {r['mapping']}/{r['type']} ({'ok' if r.get('tpu_ok') else 'fails'}): {ops}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mapping", default="", help="comma-separated mapping names: " + ", ".join(MAPPINGS))
    ap.add_argument("--types", default="", help="comma-separated model types")
    ap.add_argument("--limit", type=int, default=0, help="at most this many types per mapping")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--rerun", action="store_true", help="run types already in the results again")
    ap.add_argument("--rerun-failed", action="store_true", help="run again the types that did not pass tpuc")
    ap.add_argument(
        "--aot-eager",
        choices=("always", "on-failure"),
        default="always",
        help="run the aot_eager reference on every type, or only where tpuc does not pass (faster)",
    )
    ap.add_argument("--eager-only", action="store_true", help="build and run eager only (config work)")
    ap.add_argument("--out", type=Path, default=RESULTS / "sweep.json")
    args = ap.parse_args(argv)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers  # noqa: F401 - imported once, before forking
    import transformers.models.auto.modeling_auto  # noqa: F401

    mappings = [m for m in args.mapping.split(",") if m] or list(MAPPINGS)
    for m in mappings:
        if m not in MAPPINGS:
            ap.error(f"unknown mapping {m!r}; valid: {', '.join(MAPPINGS)}")
    wanted = {t for t in args.types.split(",") if t}
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    backends = {"always": ("aot_eager", "tpu"), "on-failure": ("tpu", "aot_eager?")}[args.aot_eager]
    if args.eager_only:
        backends = ()
    todo = []
    for m in mappings:
        ts = [t for t in types_of(m) if not wanted or t in wanted]
        if args.limit:
            ts = ts[: args.limit]
        for t in ts:
            old = results.get(key(m, t))
            if not old or args.rerun or (args.rerun_failed and not old.get("tpu_ok")):
                todo.append((m, t, backends))
            elif args.aot_eager == "always" and old.get("eager_ok") and "aot_eager_ok" not in old:
                # Done by an `on-failure` run: only the reference is missing (merged into the record).
                if not args.eager_only:
                    todo.append((m, t, ("aot_eager",)))
    # New types first, then reference-only reruns; round-robin over the mappings within each, so
    # a run cut short still covers each of them.
    ordered = []
    for only_ref in (False, True):
        part = [x for x in todo if (x[2] == ("aot_eager",)) == only_ref]
        by_mapping = {m: [x for x in part if x[0] == m] for m in mappings}
        ordered += [x for group in zip_longest(*by_mapping.values()) for x in group if x is not None]
    todo = ordered
    print(f"{len(todo)} types to run, {args.jobs} at a time", flush=True)
    t0 = time.time()
    _run_jobs(todo, args.jobs, args.timeout, results, args.out)
    wall = round(time.time() - t0, 1)
    run = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_seconds": wall,
        "types_run": len(todo),
        "command": "python bench/sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    meta = results.get("_meta") or {}
    runs = meta.get("runs") or (
        [{k: meta[k] for k in ("when", "wall_seconds", "command") if k in meta}] if meta else []
    )
    results["_meta"] = {
        "runs": runs + [run],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    save(results, args.out)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

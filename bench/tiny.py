"""What the model sweeps share to make a default Transformers config tiny (bench/sweep.py builds
every auto-mapping's types with it, bench/generate.py its static-cache decoder families): the
per-layer list cut, the walk over sub-configs, the dropout keys zeroed, the special token ids
moved into a small vocabulary."""

from __future__ import annotations

import zlib

#: Dropout-like float fields, set to 0.0 wherever a config has them (the models run in eval mode;
#: zero keeps a model that reads them at build time deterministic too).
DROPOUT_KEYS = (
    "dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_dropout",
    "attention_probs_dropout_prob",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "activation_dropout",
    "classifier_dropout",
    "dropout_rate",
    "drop_path_rate",
    "layerdrop",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "final_dropout",
    "feat_proj_dropout",
    "mask_time_prob",
    "mask_feature_prob",
    "ffn_dropout",
    "emb_dropout",
    "summary_first_dropout",
    "attention_dropout_prob",
    "hidden_dropout_rate",
    "drop_path",
)


def layer_list(values: list, n: int) -> list:
    """The first `n` entries of a per-layer list, keeping each distinct kind of entry once where
    the list has several, in order of first appearance (so a 2-layer model still has a sliding
    and a full attention layer); a list of one kind repeats it."""
    out: list = []
    for v in values:
        if v not in out:
            out.append(v)
    while len(out) < n:
        out.append(values[len(out) % len(values)])
    return out[:n]


def sub_configs(cfg) -> list:
    """The config and every config it holds, at any depth (text, vision, audio, ...), once each."""
    from transformers import PretrainedConfig

    seen: list = []
    todo = [cfg]
    while todo:
        c = todo.pop()
        if any(c is s for s in seen):
            continue
        seen.append(c)
        todo.extend(v for v in vars(c).values() if isinstance(v, PretrainedConfig))
    return seen


def fix_token_id(value: int, vocab: int, name: str) -> int:
    """A special token id of the default config that a vocabulary of `vocab` no longer has: a
    distinct id near its top (pad/bos/eos and the image/audio tokens stay distinct)."""
    return value if value < vocab else vocab - 1 - (zlib.crc32(name.encode()) % 8)  # (stable across runs)

"""A target's name (`options={"target": "tpu:v5e:2x2"}`): parsed and checked, with what it
says about the devices (chips, memory per chip). Compiling for it is targets.py."""

from __future__ import annotations

import dataclasses
import re

#: HBM per chip, bytes, by the generation names libtpu's topologies use.
HBM_PER_CHIP = {
    "v4": 32 << 30,
    "v5e": 16 << 30,
    "v5p": 95 << 30,
    "v6e": 32 << 30,
}
_TOPOLOGY = re.compile(r"^\d+x\d+(x\d+)?$")


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    family: str  # "tpu"
    generation: str  # "v5e"
    topology: str  # "2x2"

    @property
    def name(self) -> str:
        return f"{self.family}:{self.generation}:{self.topology}"

    @property
    def plugin_topology(self) -> str:
        """The plugin's own name for the devices (libtpu: `v5e:2x2`)."""
        return f"{self.generation}:{self.topology}"

    @property
    def chips(self) -> int:
        n = 1
        for d in self.topology.split("x"):
            n *= int(d)
        return n

    @property
    def hbm_bytes(self) -> int:
        return HBM_PER_CHIP[self.generation]


def parse(text) -> TargetSpec:
    """`"tpu:v5e:2x2"` -> TargetSpec; ValueError naming what is accepted otherwise."""
    expected = (
        f"'tpu:GENERATION:TOPOLOGY' with GENERATION one of {', '.join(HBM_PER_CHIP)} and TOPOLOGY "
        "as libtpu names slices (e.g. 'tpu:v5e:2x2', 'tpu:v5p:2x2x1', 'tpu:v4:2x2x1')"
    )
    parts = text.split(":") if isinstance(text, str) else []
    if len(parts) != 3 or parts[0] != "tpu":
        raise ValueError(f"tpuc: bad value for option 'target': {text!r} (expected {expected})")
    _, gen, topo = parts
    if gen not in HBM_PER_CHIP:
        raise ValueError(
            f"tpuc: bad value for option 'target': {text!r}: unknown TPU generation {gen!r} (expected {expected})"
        )
    if not _TOPOLOGY.match(topo):
        raise ValueError(
            f"tpuc: bad value for option 'target': {text!r}: bad topology {topo!r} (expected {expected})"
        )
    return TargetSpec("tpu", gen, topo)

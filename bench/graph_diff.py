"""`tpuc graph-diff` (tpuc/graph_diff.py) on torchvision's detection models of sweep_detection.py
(issue 40), with Mask R-CNN's mask errors split by paste box (`--masks`).

    .venv/bin/python bench/graph_diff.py maskrcnn_resnet50_fpn --weights random --thresh default \\
        [--locate] [--threshold 1e-5] [--at GRAPH CALL] [--sizes 224x224,200x224] [--masks]
"""

from __future__ import annotations

import argparse
import sys
import warnings

import sweep_detection  # bench/, beside this script
import torch

from tpuc.graph_diff import compare

SWEEP_SIZES = "200x240,180x160"  # sweep_detection's images


def mask_chain(ref: list, got: list, file=sys.stdout) -> None:
    """Mask R-CNN: how each detection's pasted mask differs, split by whether eager's and tpuc's
    boxes give the same integer paste box (torchvision's paste_masks_in_image truncates
    `expand_boxes(boxes, (M + 2) / M)` to int64: a coordinate one rounding apart across an
    integer moves the whole mask by a pixel)."""
    from torchvision.models.detection.roi_heads import expand_boxes

    scale = 30 / 28  # Mask R-CNN's 28x28 masks, padding 1
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        if r["masks"].shape != g["masks"].shape:
            print(f"[{i}] masks: shapes differ", file=file)
            continue
        ri = expand_boxes(r["boxes"], scale).to(torch.int64)
        gi = expand_boxes(g["boxes"], scale).to(torch.int64)
        moved = (ri != gi).any(1)
        err = (r["masks"] - g["masks"]).abs().flatten(1).amax(1)
        box_err = (r["boxes"] - g["boxes"]).abs().amax().item()
        same = err[~moved].max().item() if (~moved).any() else 0.0
        other = err[moved].max().item() if moved.any() else 0.0
        print(
            f"[{i}] {len(err)} detections, boxes within {box_err:.2g} px; integer paste box the same:"
            f" {int((~moved).sum())} (mask error up to {same:.3g}), moved by a pixel: {int(moved.sum())}"
            f" (mask error up to {other:.3g})",
            file=file,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--weights", default="random", choices=["random", "normal", "random64"])
    ap.add_argument("--thresh", default="default", choices=["default", "0"])
    ap.add_argument("--locate", action="store_true", help="per op of the first call beyond --threshold")
    ap.add_argument("--threshold", type=float, default=None, help="default: 1e-5 (float32), 1e-12 (float64)")
    ap.add_argument("--show", type=int, default=40)
    ap.add_argument("--masks", action="store_true", help="Mask R-CNN: mask errors by paste box (mask_chain)")
    ap.add_argument("--at", nargs=2, type=int, metavar=("GRAPH", "CALL"), help="locate this call instead")
    ap.add_argument(
        "--sizes",
        default=SWEEP_SIZES,
        help="the images' HxW (the sweep's; 224x224,200x224 need no resizing at min_size 224)",
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    model, images = sweep_detection._build(args.model, args.weights, args.thresh)
    if args.sizes != SWEEP_SIZES:  # otherwise the sweep's own images
        torch.manual_seed(1)
        sizes = [tuple(int(v) for v in hw.split("x")) for hw in args.sizes.split(",")]
        images = [torch.rand(3, h, w, dtype=images[0].dtype) for h, w in sizes]
    _, ref, got = compare(
        model, (images,), threshold=args.threshold, locate_call=args.locate, at=args.at, show=args.show
    )
    print("final (per detection field):", sweep_detection._compare(ref, got))
    if args.masks:
        mask_chain(ref, got)


if __name__ == "__main__":
    main()

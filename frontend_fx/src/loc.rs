//! Source locations: where in the user's Python code an FX node comes from, read from the
//! node's `stack_trace` (the frames Dynamo traced, as `traceback` formats them).

use serde::{Deserialize, Serialize};
use std::fmt;

/// One frame of the user's Python code: file, line, column (0: not known) and function.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    pub file: String,
    pub line: u32,
    #[serde(default)]
    pub col: u32,
    #[serde(default)]
    pub func: String,
}

/// Where in the user's code a node comes from: the user's frames of the FX node's
/// `stack_trace`, innermost first (PyTorch's own frames left out). Lowering puts it on every
/// StableHLO op the node becomes (see `compiler/src/lower`); it is never part of a cache key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SourceLoc {
    pub frames: Vec<Frame>,
}

impl SourceLoc {
    /// The innermost user frame.
    pub fn frame(&self) -> Option<&Frame> {
        self.frames.first()
    }
}

impl fmt::Display for SourceLoc {
    /// `file.py:12` of the innermost frame.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.frame() {
            Some(fr) => write!(f, "{}:{}", fr.file, fr.line),
            None => f.write_str("?"),
        }
    }
}

/// At most this many frames are kept per node (innermost first).
pub const MAX_FRAMES: usize = 8;

impl SourceLoc {
    /// The user's frames of an FX `stack_trace` (`  File "f.py", line 3, in fn` lines,
    /// outermost first as `traceback` prints them), innermost first; frames whose file starts
    /// with one of `skip` (PyTorch's own package) are left out. None when no frame is left.
    pub fn from_stack_trace(text: &str, skip: &[&str]) -> Option<SourceLoc> {
        let mut frames: Vec<Frame> = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix("File \"") else {
                continue;
            };
            let Some((file, rest)) = rest.split_once('"') else {
                continue;
            };
            let Some(rest) = rest.strip_prefix(", line ") else {
                continue;
            };
            let (num, func) = match rest.split_once(", in ") {
                Some((n, f)) => (n, f.trim()),
                None => (rest.trim(), ""),
            };
            let Ok(line) = num.trim().parse::<u32>() else {
                continue;
            };
            if skip.iter().any(|p| !p.is_empty() && file.starts_with(p)) {
                continue;
            }
            frames.push(Frame {
                file: file.to_string(),
                line,
                col: 0,
                func: func.to_string(),
            });
        }
        frames.reverse();
        frames.truncate(MAX_FRAMES);
        (!frames.is_empty()).then_some(SourceLoc { frames })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "  File \"/home/u/train.py\", line 40, in step\n    out = model(x)\n  File \"/home/u/model.py\", line 12, in forward\n    return torch.relu(self.lin(x)) * 2\n           ~~~~~~~~~~~~~~~~~~~~~~~^~~\n  File \"/venv/torch/nn/modules/linear.py\", line 134, in forward\n    return F.linear(input, self.weight, self.bias)\n";

    #[test]
    fn innermost_user_frame_first() {
        let loc = SourceLoc::from_stack_trace(TRACE, &["/venv/torch/"]).unwrap();
        assert_eq!(loc.frames.len(), 2);
        assert_eq!(loc.frame().unwrap().file, "/home/u/model.py");
        assert_eq!(loc.frame().unwrap().line, 12);
        assert_eq!(loc.frame().unwrap().func, "forward");
        assert_eq!(loc.frames[1].line, 40);
        assert_eq!(loc.to_string(), "/home/u/model.py:12");
    }

    #[test]
    fn nothing_without_user_frames() {
        assert!(SourceLoc::from_stack_trace("", &[]).is_none());
        assert!(SourceLoc::from_stack_trace("garbage\n  File \"x\"", &[]).is_none());
        let only_torch = "  File \"/venv/torch/a.py\", line 1, in f\n";
        assert!(SourceLoc::from_stack_trace(only_torch, &["/venv/torch/"]).is_none());
    }
}

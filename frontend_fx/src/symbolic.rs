//! Symbolic sizes: the sympy expressions PyTorch's ShapeEnv prints (`s77`, `2*s0`,
//! `((s0 - 1)//2) + 1`, `Max(1, s0)`), parsed once and evaluated when concrete sizes are known.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SymbolError {
    #[error("cannot parse symbolic size `{expr}`: {reason}")]
    Parse { expr: String, reason: String },
    #[error("symbolic size `{expr}` uses `{symbol}`, which no input binds")]
    Unbound { expr: String, symbol: String },
    #[error("symbolic size `{expr}` divides by zero")]
    DivByZero { expr: String },
}

/// One dimension of a tensor type: a known size or a symbolic expression.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Dim {
    Static(i64),
    Sym(SymExpr),
}

impl Dim {
    pub fn as_static(&self) -> Option<i64> {
        match self {
            Dim::Static(n) => Some(*n),
            Dim::Sym(_) => None,
        }
    }

    pub fn eval(&self, bindings: &HashMap<String, i64>) -> Result<i64, SymbolError> {
        match self {
            Dim::Static(n) => Ok(*n),
            Dim::Sym(e) => e.eval(bindings),
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Static(n) => write!(f, "{n}"),
            Dim::Sym(e) => write!(f, "{e}"),
        }
    }
}

/// A parsed symbolic integer expression; it (de)serializes as its source text.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SymExpr {
    text: String,
    tree: Expr,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Expr {
    Int(i64),
    Sym(String),
    Neg(Box<Expr>),
    Bin(Op, Box<Expr>, Box<Expr>),
    Call(String, Vec<Expr>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Op {
    Add,
    Sub,
    Mul,
    FloorDiv,
    Mod,
}

impl SymExpr {
    pub fn parse(text: &str) -> Result<SymExpr, SymbolError> {
        let mut p = Parser {
            src: text,
            toks: tokenize(text)?,
            pos: 0,
        };
        let tree = p.expr()?;
        if p.pos != p.toks.len() {
            return Err(p.err("unexpected trailing input"));
        }
        Ok(SymExpr {
            text: text.to_string(),
            tree,
        })
    }

    /// The symbol itself when the expression is a bare symbol (`s77`).
    pub fn as_symbol(&self) -> Option<&str> {
        match &self.tree {
            Expr::Sym(s) => Some(s),
            _ => None,
        }
    }

    /// `(c, [s1, s2, ...])` when the expression is a product of an integer and symbols
    /// (`s0`, `2*s0`, `s0*s1`): the shape of a dim that merges whole dims.
    pub fn as_product(&self) -> Option<(i64, Vec<String>)> {
        fn walk(e: &Expr, c: &mut i64, syms: &mut Vec<String>) -> bool {
            match e {
                Expr::Int(n) => {
                    *c *= n;
                    true
                }
                Expr::Sym(s) => {
                    syms.push(s.clone());
                    true
                }
                Expr::Bin(Op::Mul, a, b) => walk(a, c, syms) && walk(b, c, syms),
                _ => false,
            }
        }
        let (mut c, mut syms) = (1, Vec::new());
        walk(&self.tree, &mut c, &mut syms).then_some((c, syms))
    }

    pub fn symbols(&self) -> Vec<String> {
        fn walk(e: &Expr, out: &mut Vec<String>) {
            match e {
                Expr::Int(_) => {}
                Expr::Sym(s) => {
                    if !out.contains(s) {
                        out.push(s.clone())
                    }
                }
                Expr::Neg(a) => walk(a, out),
                Expr::Bin(_, a, b) => {
                    walk(a, out);
                    walk(b, out)
                }
                Expr::Call(_, args) => args.iter().for_each(|a| walk(a, out)),
            }
        }
        let mut out = Vec::new();
        walk(&self.tree, &mut out);
        out
    }

    pub fn eval(&self, bindings: &HashMap<String, i64>) -> Result<i64, SymbolError> {
        self.eval_expr(&self.tree, bindings)
    }

    fn eval_expr(&self, e: &Expr, b: &HashMap<String, i64>) -> Result<i64, SymbolError> {
        let div0 = || SymbolError::DivByZero {
            expr: self.text.clone(),
        };
        Ok(match e {
            Expr::Int(n) => *n,
            Expr::Sym(s) => *b.get(s).ok_or_else(|| SymbolError::Unbound {
                expr: self.text.clone(),
                symbol: s.clone(),
            })?,
            Expr::Neg(a) => -self.eval_expr(a, b)?,
            Expr::Bin(op, x, y) => {
                let (x, y) = (self.eval_expr(x, b)?, self.eval_expr(y, b)?);
                match op {
                    Op::Add => x + y,
                    Op::Sub => x - y,
                    Op::Mul => x * y,
                    Op::FloorDiv => x.checked_div_euclid(y).ok_or_else(div0)?,
                    Op::Mod => x.checked_rem_euclid(y).ok_or_else(div0)?,
                }
            }
            Expr::Call(f, args) => {
                let vals = args
                    .iter()
                    .map(|a| self.eval_expr(a, b))
                    .collect::<Result<Vec<_>, _>>()?;
                match (f.as_str(), vals.as_slice()) {
                    ("Max", v) if !v.is_empty() => *v.iter().max().unwrap(),
                    ("Min", v) if !v.is_empty() => *v.iter().min().unwrap(),
                    ("FloorDiv", [x, y]) => x.checked_div_euclid(*y).ok_or_else(div0)?,
                    ("CeilDiv" | "CeilToInt", [x, y]) => {
                        if *y == 0 {
                            return Err(div0());
                        }
                        (x + y - 1).div_euclid(*y)
                    }
                    ("Mod" | "PythonMod", [x, y]) => x.checked_rem_euclid(*y).ok_or_else(div0)?,
                    _ => {
                        return Err(SymbolError::Parse {
                            expr: self.text.clone(),
                            reason: format!("unsupported function {f} with {} args", vals.len()),
                        })
                    }
                }
            }
        })
    }
}

impl TryFrom<String> for SymExpr {
    type Error = SymbolError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        SymExpr::parse(&s)
    }
}

impl From<SymExpr> for String {
    fn from(e: SymExpr) -> String {
        e.text
    }
}

impl fmt::Display for SymExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Int(i64),
    Ident(String),
    Punct(&'static str),
}

fn tokenize(src: &str) -> Result<Vec<Tok>, SymbolError> {
    let err = |reason: String| SymbolError::Parse {
        expr: src.to_string(),
        reason,
    };
    let bytes = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            let n = src[start..i]
                .parse()
                .map_err(|e| err(format!("bad integer: {e}")))?;
            out.push(Tok::Int(n));
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(src[start..i].to_string()));
        } else if src[i..].starts_with("//") {
            out.push(Tok::Punct("//"));
            i += 2;
        } else {
            let p = match c {
                '+' => "+",
                '-' => "-",
                '*' => "*",
                '%' => "%",
                '(' => "(",
                ')' => ")",
                ',' => ",",
                _ => return Err(err(format!("unexpected character `{c}`"))),
            };
            out.push(Tok::Punct(p));
            i += 1;
        }
    }
    Ok(out)
}

struct Parser<'s> {
    src: &'s str,
    toks: Vec<Tok>,
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, reason: &str) -> SymbolError {
        SymbolError::Parse {
            expr: self.src.to_string(),
            reason: reason.to_string(),
        }
    }

    fn eat(&mut self, p: &str) -> bool {
        if matches!(self.toks.get(self.pos), Some(Tok::Punct(q)) if *q == p) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expr(&mut self) -> Result<Expr, SymbolError> {
        let mut lhs = self.term()?;
        loop {
            let op = if self.eat("+") {
                Op::Add
            } else if self.eat("-") {
                Op::Sub
            } else {
                return Ok(lhs);
            };
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(self.term()?));
        }
    }

    fn term(&mut self) -> Result<Expr, SymbolError> {
        let mut lhs = self.unary()?;
        loop {
            let op = if self.eat("*") {
                Op::Mul
            } else if self.eat("//") {
                Op::FloorDiv
            } else if self.eat("%") {
                Op::Mod
            } else {
                return Ok(lhs);
            };
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(self.unary()?));
        }
    }

    fn unary(&mut self) -> Result<Expr, SymbolError> {
        if self.eat("-") {
            return Ok(Expr::Neg(Box::new(self.unary()?)));
        }
        self.atom()
    }

    fn atom(&mut self) -> Result<Expr, SymbolError> {
        match self.toks.get(self.pos).cloned() {
            Some(Tok::Int(n)) => {
                self.pos += 1;
                Ok(Expr::Int(n))
            }
            Some(Tok::Ident(name)) => {
                self.pos += 1;
                if self.eat("(") {
                    let mut args = vec![self.expr()?];
                    while self.eat(",") {
                        args.push(self.expr()?);
                    }
                    if !self.eat(")") {
                        return Err(self.err("expected `)`"));
                    }
                    Ok(Expr::Call(name, args))
                } else {
                    Ok(Expr::Sym(name))
                }
            }
            Some(Tok::Punct("(")) => {
                self.pos += 1;
                let e = self.expr()?;
                if !self.eat(")") {
                    return Err(self.err("expected `)`"));
                }
                Ok(e)
            }
            _ => Err(self.err("expected a number, a symbol or `(`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(text: &str, binds: &[(&str, i64)]) -> Result<i64, SymbolError> {
        let b = binds.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        SymExpr::parse(text)?.eval(&b)
    }

    #[test]
    fn evaluates_shape_env_expressions() {
        assert_eq!(eval("s77", &[("s77", 5)]), Ok(5));
        assert_eq!(eval("2*s0 + 1", &[("s0", 3)]), Ok(7));
        assert_eq!(eval("((s0 - 1)//2) + 1", &[("s0", 8)]), Ok(4));
        assert_eq!(eval("Max(1, s0 - 10)", &[("s0", 3)]), Ok(1));
        assert_eq!(eval("-s0 + 10", &[("s0", 3)]), Ok(7));
        assert_eq!(eval("Mod(s0, 4)", &[("s0", 10)]), Ok(2));
        assert_eq!(eval("CeilDiv(s0, 4)", &[("s0", 10)]), Ok(3));
    }

    #[test]
    fn reports_unbound_and_bad_input() {
        assert!(matches!(
            eval("s1*2", &[("s0", 1)]),
            Err(SymbolError::Unbound { .. })
        ));
        assert!(matches!(eval("s0 +", &[]), Err(SymbolError::Parse { .. })));
        assert!(matches!(
            eval("s0 // 0", &[("s0", 1)]),
            Err(SymbolError::DivByZero { .. })
        ));
    }

    #[test]
    fn dims_deserialize_from_int_or_text() {
        let dims: Vec<Dim> = serde_json::from_str(r#"[4, "s0*2"]"#).unwrap();
        assert_eq!(dims[0], Dim::Static(4));
        assert_eq!(dims[1].to_string(), "s0*2");
        assert_eq!(SymExpr::parse("s0*2").unwrap().symbols(), vec!["s0"]);
    }
}

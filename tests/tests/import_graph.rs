//! No import circles between the workspace's files (issue 30).
//!
//! Every crate target of the workspace (each member's `src/lib.rs`, `src/main.rs`, `src/bin/*`,
//! `tests/*.rs`, `benches/*.rs`, and `fuzz/fuzz_targets/*.rs`) is walked from its root through
//! its `mod name;` declarations. In every file, each `use` tree and each path that starts with
//! `crate::`, `super::`, `self::` or a child module's name is resolved to the file that defines
//! the item it names, following `use`/`pub use` re-exports (so `crate::Engine` means
//! `engine/mod.rs`, not `lib.rs`). That gives a graph "module A imports from module B"; this
//! test fails listing every strongly connected component with more than one node.
//!
//! Choices (the issue does not say):
//! - a re-export (`pub use crate::x::Y` in file A) is an import of A from x's file: a facade that
//!   re-exports a module which imports back from the facade is a circle;
//! - the graph is over sibling modules, at every level of each crate's module tree: a module
//!   with its submodules is one node among its siblings (an import from `snapshot.rs` of an
//!   item in `engine/tree.rs` is the edge `snapshot` → `engine`, shown as the files
//!   `snapshot.rs` and `engine/mod.rs`), and `engine/gate.rs` and `engine/child.rs` are nodes
//!   under `engine`. A module and its own submodules are one unit: `engine/gate.rs` using
//!   `super::Engine`, or `lib.rs` re-exporting `engine::Engine`, is no edge (submodules are the
//!   parent split into files);
//! - a `mod x;` declaration is not an import (a parent owns its children), and method calls are
//!   not imports (only paths are);
//! - paths into other crates are ignored (cargo already forbids crate cycles);
//! - the checker is a small tokenizer, not a Rust parser: comments, strings and char literals are
//!   skipped, inline `mod x { … }` blocks are tracked (so `super::*` in an inline `mod tests`
//!   means the file itself), and `#[path]` is not supported (the workspace does not use it).
//!
//! There is no allow-list: io-tokio's circle (`api` <-> `daemon` <-> `follow` <-> `forward` <->
//! `web`, with `config`, `connections`, `openapi` and `postgres` drawn in) was broken up by
//! leaves (`http`: the error envelope and limits; `auth`: secrets and the cluster secret;
//! `outbox`: the live rows; `durability`) that the daemon and the routes both build on.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Punct(char),
}

/// Rust source to identifiers, `::` and single punctuation; comments, strings, chars dropped.
fn tokenize(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let n = c.len();
    while i < n {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(&c, i + 1);
        } else if let Some((hashes, body)) = (!prev_is_ident(&c, i))
            .then(|| raw_string_start(&c, i))
            .flatten()
        {
            if hashes == usize::MAX {
                i = skip_string(&c, body);
            } else {
                // Raw string: ends at `"` followed by `hashes` `#`.
                let mut j = body;
                while j < n {
                    if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                i = j;
            }
        } else if ch == '\'' {
            if c.get(i + 1) == Some(&'\\') {
                let mut j = i + 2;
                while j < n && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                // A lifetime or label.
                i += 1;
                while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let mut word: String = c[start..i].iter().collect();
            if word == "r" && c.get(i) == Some(&'#') {
                // r#ident
                let s = i + 1;
                i = s;
                while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                word = c[s..i].iter().collect();
            }
            out.push(Tok::Ident(word));
        } else if ch.is_ascii_digit() {
            while i < n && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                if c[i] == '.' && !c.get(i + 1).is_some_and(|d| d.is_ascii_digit()) {
                    break;
                }
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::Colons);
            i += 2;
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    out
}

fn prev_is_ident(c: &[char], i: usize) -> bool {
    i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_')
}

/// At `r"`, `r#"`, `br"`, `b"`: `Some((hashes, body_start))`; `hashes == usize::MAX` for `b"`.
fn raw_string_start(c: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if c[j] == 'b' {
        j += 1;
        if c.get(j) == Some(&'"') {
            return Some((usize::MAX, j + 1));
        }
        if c.get(j) == Some(&'\'') {
            return None;
        }
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (c.get(j) == Some(&'"')).then_some((hashes, j + 1))
}

fn skip_string(c: &[char], mut i: usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// One `use` leaf: the path (as written), whether it ends in `*`, and the name it binds.
#[derive(Debug, Clone)]
struct UseLeaf {
    path: Vec<String>,
    glob: bool,
    name: Option<String>,
}

/// What one file says: module paths of its inline modules, its `mod x;` children (per inline
/// module), the items it defines, its `use` leaves and other paths (with the module they are in).
#[derive(Debug, Default)]
struct FileFacts {
    /// `mod x;` declarations: (inline module path relative to the file, child name).
    children: Vec<(Vec<String>, String)>,
    /// Inline `mod x { … }` paths relative to the file.
    inline: Vec<Vec<String>>,
    /// Items defined: (inline module path, name).
    defs: BTreeSet<(Vec<String>, String)>,
    /// `use` leaves: (inline module path, leaf).
    uses: Vec<(Vec<String>, UseLeaf)>,
    /// Other paths: (inline module path, segments).
    paths: Vec<(Vec<String>, Vec<String>)>,
}

fn ident(t: Option<&Tok>) -> Option<&str> {
    match t {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

const ITEM_KEYWORDS: &[&str] = &[
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];

fn facts(src: &str) -> FileFacts {
    let toks = tokenize(src);
    let mut f = FileFacts::default();
    // Brace stack: Some(name) for an inline module's brace, None for any other brace.
    let mut stack: Vec<Option<String>> = Vec::new();
    let inline_path =
        |stack: &Vec<Option<String>>| stack.iter().flatten().cloned().collect::<Vec<_>>();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct('{') => {
                stack.push(None);
                i += 1;
            }
            Tok::Punct('}') => {
                stack.pop();
                i += 1;
            }
            Tok::Ident(kw) if kw == "mod" => {
                let Some(name) = ident(toks.get(i + 1)) else {
                    i += 1;
                    continue;
                };
                let here = inline_path(&stack);
                match toks.get(i + 2) {
                    Some(Tok::Punct(';')) => {
                        f.children.push((here.clone(), name.to_string()));
                        f.defs.insert((here, name.to_string()));
                        i += 3;
                    }
                    Some(Tok::Punct('{')) => {
                        f.defs.insert((here.clone(), name.to_string()));
                        let mut p = here;
                        p.push(name.to_string());
                        f.inline.push(p);
                        stack.push(Some(name.to_string()));
                        i += 3;
                    }
                    _ => i += 1,
                }
            }
            Tok::Ident(kw) if kw == "use" => {
                let here = inline_path(&stack);
                let mut j = i + 1;
                let mut leaves = Vec::new();
                parse_use_tree(&toks, &mut j, Vec::new(), &mut leaves);
                for l in leaves {
                    f.uses.push((here.clone(), l));
                }
                i = j;
            }
            Tok::Ident(kw) if kw == "macro_rules" => {
                if let (Some(Tok::Punct('!')), Some(name)) =
                    (toks.get(i + 1), ident(toks.get(i + 2)))
                {
                    f.defs.insert((inline_path(&stack), name.to_string()));
                }
                i += 1;
            }
            Tok::Ident(kw) if ITEM_KEYWORDS.contains(&kw.as_str()) => {
                if let Some(name) = ident(toks.get(i + 1)) {
                    f.defs.insert((inline_path(&stack), name.to_string()));
                }
                i += 1;
            }
            Tok::Ident(first) => {
                // A path `a::b::c` (not preceded by `::`, which would make it a continuation).
                if i > 0 && toks[i - 1] == Tok::Colons {
                    i += 1;
                    continue;
                }
                let mut segs = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Colons) {
                    match ident(toks.get(j + 1)) {
                        Some(s) => {
                            segs.push(s.to_string());
                            j += 2;
                        }
                        None => break,
                    }
                }
                if segs.len() > 1 {
                    f.paths.push((inline_path(&stack), segs));
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    f
}

/// Parses a use tree at `*j` (after `use`, possibly after `::`), up to `;` / `,` / `}`.
fn parse_use_tree(toks: &[Tok], j: &mut usize, prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    let mut path = prefix;
    if toks.get(*j) == Some(&Tok::Colons) {
        *j += 1;
    }
    loop {
        match toks.get(*j) {
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *j += 1;
                match toks.get(*j) {
                    Some(Tok::Colons) => *j += 1,
                    Some(Tok::Ident(kw)) if kw == "as" => {
                        let alias = ident(toks.get(*j + 1)).map(str::to_string);
                        *j += 2;
                        out.push(UseLeaf {
                            path,
                            glob: false,
                            name: alias,
                        });
                        break;
                    }
                    _ => {
                        let name = path.last().cloned();
                        out.push(UseLeaf {
                            path,
                            glob: false,
                            name,
                        });
                        break;
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                *j += 1;
                out.push(UseLeaf {
                    path,
                    glob: true,
                    name: None,
                });
                break;
            }
            Some(Tok::Punct('{')) => {
                *j += 1;
                loop {
                    match toks.get(*j) {
                        Some(Tok::Punct('}')) => {
                            *j += 1;
                            break;
                        }
                        Some(Tok::Punct(',')) => *j += 1,
                        None => return,
                        _ => {
                            let before = *j;
                            parse_use_tree(toks, j, path.clone(), out);
                            if *j == before {
                                *j += 1;
                            }
                        }
                    }
                }
                break;
            }
            _ => break,
        }
    }
    if toks.get(*j) == Some(&Tok::Punct(';')) {
        *j += 1;
    }
}

/// One crate target: its files by module path.
struct CrateTree {
    /// Module path → file (relative to the workspace root).
    modules: BTreeMap<Vec<String>, String>,
    facts: BTreeMap<String, FileFacts>,
    /// File → its module path.
    file_module: BTreeMap<String, Vec<String>>,
}

fn load_crate(root: &Path, root_file: &Path) -> CrateTree {
    let mut t = CrateTree {
        modules: BTreeMap::new(),
        facts: BTreeMap::new(),
        file_module: BTreeMap::new(),
    };
    // (file, module path, directory its children live in)
    let root_dir = root_file.parent().unwrap_or(root).to_path_buf();
    let mut todo: Vec<(PathBuf, Vec<String>, PathBuf)> =
        vec![(root_file.to_path_buf(), Vec::new(), root_dir)];
    while let Some((file, module, dir)) = todo.pop() {
        let Ok(src) = fs::read_to_string(&file) else {
            continue;
        };
        let rel = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .to_string_lossy()
            .replace('\\', "/");
        let ff = facts(&src);
        for inl in &ff.inline {
            let mut m = module.clone();
            m.extend(inl.iter().cloned());
            t.modules.insert(m, rel.clone());
        }
        for (inl, child) in &ff.children {
            let mut child_dir = dir.clone();
            for s in inl {
                child_dir.push(s);
            }
            let flat = child_dir.join(format!("{child}.rs"));
            let nested = child_dir.join(child).join("mod.rs");
            let mut m = module.clone();
            m.extend(inl.iter().cloned());
            m.push(child.clone());
            if flat.exists() {
                todo.push((flat, m, child_dir.join(child)));
            } else if nested.exists() {
                todo.push((nested, m, child_dir.join(child)));
            }
        }
        t.modules.insert(module.clone(), rel.clone());
        t.file_module.insert(rel.clone(), module);
        t.facts.insert(rel, ff);
    }
    t
}

impl CrateTree {
    /// The absolute module path of `segs` written in module `at` (None: another crate).
    fn absolute(&self, at: &[String], segs: &[String]) -> Option<Vec<String>> {
        let first = segs.first()?;
        let mut base: Vec<String> = match first.as_str() {
            "crate" => Vec::new(),
            "self" => at.to_vec(),
            "super" => {
                let mut b = at.to_vec();
                let mut k = 0;
                while segs.get(k).map(String::as_str) == Some("super") {
                    b.pop()?;
                    k += 1;
                }
                b.extend(segs[k..].iter().cloned());
                return Some(b);
            }
            name => {
                let mut m = at.to_vec();
                m.push(name.to_string());
                if self.modules.contains_key(&m) {
                    at.to_vec()
                } else {
                    return None;
                }
            }
        };
        let skip = usize::from(matches!(first.as_str(), "crate" | "self"));
        base.extend(segs[skip..].iter().cloned());
        Some(base)
    }

    /// The file defining the item at absolute path `abs`, following re-exports.
    fn resolve(&self, abs: &[String], depth: usize) -> Option<String> {
        // Longest prefix that is a module.
        let mut k = abs.len();
        while k > 0 && !self.modules.contains_key(&abs[..k]) {
            k -= 1;
        }
        let module = &abs[..k];
        let file = self.modules.get(module)?.clone();
        let Some(item) = abs.get(k) else {
            return Some(file);
        };
        if depth > 16 {
            return Some(file);
        }
        let ff = &self.facts[&file];
        let file_mod = &self.file_module[&file];
        let inl: Vec<String> = module[file_mod.len()..].to_vec();
        if ff.defs.contains(&(inl.clone(), item.clone())) {
            return Some(file);
        }
        for (at, leaf) in &ff.uses {
            if *at == inl && !leaf.glob && leaf.name.as_deref() == Some(item.as_str()) {
                let mut at_abs = file_mod.clone();
                at_abs.extend(at.iter().cloned());
                if let Some(target) = self.absolute(&at_abs, &leaf.path) {
                    return self.resolve(&target, depth + 1).or(Some(file));
                }
                return Some(file);
            }
        }
        for (at, leaf) in &ff.uses {
            if *at == inl && leaf.glob {
                let mut at_abs = file_mod.clone();
                at_abs.extend(at.iter().cloned());
                if let Some(mut target) = self.absolute(&at_abs, &leaf.path) {
                    target.push(item.clone());
                    if let Some(found) = self.resolve(&target, depth + 1) {
                        let defined = self.facts[&found].defs.iter().any(|(_, n)| n == item);
                        if defined && found != file {
                            return Some(found);
                        }
                    }
                }
            }
        }
        Some(file)
    }

    /// Edges: file → files it imports from.
    fn edges(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut e: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (file, ff) in &self.facts {
            let file_mod = &self.file_module[file];
            let written = ff
                .uses
                .iter()
                .map(|(at, l)| (at, &l.path))
                .chain(ff.paths.iter().map(|(at, p)| (at, p)));
            for (at, path) in written {
                let mut at_abs = file_mod.clone();
                at_abs.extend(at.iter().cloned());
                let Some(abs) = self.absolute(&at_abs, path) else {
                    continue;
                };
                let Some(target) = self.resolve(&abs, 0) else {
                    continue;
                };
                let (a, b) = (file_mod, &self.file_module[&target]);
                // A module and its own submodules are one unit (see the module docs).
                if a.starts_with(b) || b.starts_with(a) {
                    continue;
                }
                // Lift the edge to the two sibling modules under the common parent.
                let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
                let (from, to) = (&a[..=common], &b[..=common]);
                if let (Some(ff), Some(tf)) = (self.modules.get(from), self.modules.get(to)) {
                    e.entry(ff.clone()).or_default().insert(tf.clone());
                }
            }
            e.entry(file.clone()).or_default();
        }
        e
    }
}

/// Strongly connected components with more than one node (Tarjan).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct St<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        on: BTreeSet<&'a str>,
        stack: Vec<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut St<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on.insert(v);
        let edges = s.edges;
        if let Some(ws) = edges.get(v) {
            for w in ws {
                if !s.index.contains_key(w.as_str()) {
                    visit(s, w);
                    let lw = s.low[w.as_str()];
                    let lv = s.low[v];
                    s.low.insert(v, lv.min(lw));
                } else if s.on.contains(w.as_str()) {
                    let iw = s.index[w.as_str()];
                    let lv = s.low[v];
                    s.low.insert(v, lv.min(iw));
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        on: BTreeSet::new(),
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// Every crate target root of the workspace at `ws`.
fn crate_roots(ws: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let mut member_dirs = vec![ws.join("fuzz")];
    let manifest = fs::read_to_string(ws.join("Cargo.toml")).unwrap_or_default();
    if let Some(line) = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
    {
        for m in line.split('"').skip(1).step_by(2) {
            member_dirs.push(ws.join(m));
        }
    }
    for dir in member_dirs {
        for f in ["src/lib.rs", "src/main.rs"] {
            if dir.join(f).exists() {
                roots.push(dir.join(f));
            }
        }
        for sub in ["src/bin", "tests", "benches", "fuzz_targets", "examples"] {
            let Ok(rd) = fs::read_dir(dir.join(sub)) else {
                continue;
            };
            let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            entries.sort();
            for p in entries {
                if p.extension().is_some_and(|e| e == "rs") {
                    roots.push(p);
                } else if p.join("main.rs").exists() {
                    roots.push(p.join("main.rs"));
                }
            }
        }
    }
    roots
}

/// The import circles of the workspace at `ws` (each sorted, files relative to `ws`).
fn workspace_circles(ws: &Path) -> (Vec<Vec<String>>, usize) {
    let mut all = Vec::new();
    let mut files = BTreeSet::new();
    for root in crate_roots(ws) {
        let tree = load_crate(ws, &root);
        files.extend(tree.facts.keys().cloned());
        for c in circles(&tree.edges()) {
            if !all.contains(&c) {
                all.push(c);
            }
        }
    }
    all.sort();
    (all, files.len())
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

#[test]
fn the_workspace_has_no_import_circles() {
    let ws = workspace();
    let (circles, files) = workspace_circles(&ws);
    assert!(
        files > 100,
        "the checker found only {files} files under {ws:?}"
    );
    let bad: Vec<&Vec<String>> = circles.iter().collect();
    assert!(
        bad.is_empty(),
        "import circles between files (A uses B and B uses A, directly or through others):\n{}",
        bad.iter()
            .map(|c| format!("  {}", c.join(" <-> ")))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Writes a tiny crate and returns the circles the checker finds in it.
fn circles_of(files: &[(&str, &str)]) -> Vec<Vec<String>> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for (path, src) in files {
        let p = dir.path().join(path);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).expect("a directory");
        }
        fs::write(&p, src).expect("a file");
    }
    let tree = load_crate(dir.path(), &dir.path().join("src/lib.rs"));
    circles(&tree.edges())
}

#[test]
fn the_checker_finds_a_circle_through_use_super_and_reexports() {
    // a uses c's Thing through b's re-export; c calls into its child d (one unit with c);
    // d uses a through `super::super`: one circle a <-> c (b only re-exports, it is not in it).
    let found = circles_of(&[
        ("src/lib.rs", "mod a; mod b; pub mod c;\npub use b::Thing;"),
        ("src/a.rs", "use crate::b::Thing;\npub struct A;"),
        ("src/b.rs", "pub use crate::c::Thing;"),
        (
            "src/c/mod.rs",
            "mod d;\npub struct Thing;\npub fn g() { d::f(); }",
        ),
        ("src/c/d.rs", "pub fn f() { let _ = super::super::a::A; }"),
    ]);
    let want = vec![vec!["src/a.rs".to_string(), "src/c/mod.rs".to_string()]];
    assert_eq!(found, want);
}

#[test]
fn the_checker_ignores_comments_strings_inline_test_modules_and_other_crates() {
    // a mentions b only in a comment, a string and a raw string; its inline `mod tests` uses
    // `super::*` (a itself); b uses a and another crate. No circle.
    let found = circles_of(&[
        ("src/lib.rs", "mod a; mod b;"),
        (
            "src/a.rs",
            "// crate::b::B\n/* crate::b::B */\npub const S: &str = \"crate::b::B\";\n\
             pub const R: &str = r#\"crate::b::B\"#;\npub struct A<'x>(&'x str);\n\
             #[cfg(test)]\nmod tests { use super::*; fn t() { let _ = S; } }",
        ),
        (
            "src/b.rs",
            "use crate::a::A;\nuse serde::Serialize;\npub struct B;",
        ),
    ]);
    assert!(found.is_empty(), "{found:?}");
    // The same crate with one real use of b in a: a circle.
    let found = circles_of(&[
        ("src/lib.rs", "mod a; mod b;"),
        ("src/a.rs", "pub struct A;\nfn f() { let _ = crate::b::B; }"),
        ("src/b.rs", "use crate::a::A;\npub struct B;"),
    ]);
    assert_eq!(
        found,
        vec![vec!["src/a.rs".to_string(), "src/b.rs".to_string()]]
    );
}

/// Issue 30 item 1, io-tokio in layers: the leaves (the HTTP envelope and limits, auth, the
/// outbox's live rows, durability, the clock, the reads, retention's positions) and `follow`
/// (over its narrow `OutboxSource` trait) import nothing from the daemon core or the routes, and
/// the daemon core imports none of the routes. A circle check alone would let a leaf grow an
/// import of the daemon as long as the daemon stopped importing it back.
#[test]
fn io_tokio_modules_import_only_from_the_layers_below_them() {
    let ws = workspace();
    let tree = load_crate(&ws, &ws.join("io-tokio/src/lib.rs"));
    let edges = tree.edges();
    let file = |m: &str| format!("io-tokio/src/{m}.rs");
    let below_the_daemon = [
        "http",
        "auth",
        "outbox",
        "durability",
        "clock",
        "reads",
        "retention",
        "follow",
    ];
    let daemon_and_up = ["daemon", "api", "forward", "web/mod", "tuttid"];
    let routes = ["api", "forward", "web/mod", "tuttid"];
    let mut wrong = Vec::new();
    let mut check = |from: &str, forbidden: &[&str]| {
        let Some(targets) = edges.get(&file(from)) else {
            return;
        };
        for to in forbidden {
            if targets.contains(&file(to)) {
                wrong.push(format!("{from} -> {to}"));
            }
        }
    };
    for m in below_the_daemon {
        check(m, &daemon_and_up);
    }
    check("daemon", &routes);
    assert!(
        edges.contains_key(&file("daemon")) && edges.contains_key(&file("api")),
        "the checker found no io-tokio edges: {:?}",
        edges.keys().collect::<Vec<_>>()
    );
    assert!(wrong.is_empty(), "imports against the layers: {wrong:?}");
}

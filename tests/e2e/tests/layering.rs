//! The workspace's shape, checked: crates depend on each other in one direction only, the engine
//! pulls in no server or command-line crates, library code has typed errors and no environment
//! tricks, and no crate's modules import each other in a cycle (`docs/architecture.md`).
//!
//! These read `Cargo.toml` files and sources as text: no build of the crates under test needed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Workspace crates from the bottom up: a crate may depend only on crates of a lower rank.
const RANKS: &[(&str, &str, u32)] = &[
    ("proto", "tandem-proto", 0),
    ("model", "tandem-model", 0),
    ("kernels", "tandem-kernels", 0),
    ("engine", "tandem-engine", 1),
    ("serve", "tandem-serve", 1),
    ("tests/support", "tandem-test-support", 1),
    ("transport", "tandem-transport", 2),
    ("router", "tandem-router", 2),
    ("worker", "tandem-worker", 3),
    ("prefill-node", "tandem-prefill", 4),
    ("decode-node", "tandem-decode", 4),
    ("cli", "tandem-cli", 5),
    ("tests/e2e", "tandem-e2e", 6),
];

/// Library crates: no `anyhow` and no `std::env::set_var` outside a binary's `main.rs`.
const LIBRARIES: &[&str] = &[
    "proto",
    "model",
    "kernels",
    "engine",
    "transport",
    "serve",
    "worker",
    "router",
    "prefill-node",
    "decode-node",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The package names listed in one `[section]` of a manifest (the `name.workspace = true` and
/// `name = ...` forms used in this workspace).
fn section_deps(manifest: &str, section: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut inside = false;
    for line in manifest.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            inside = t == format!("[{section}]");
            continue;
        }
        if inside && !t.is_empty() && !t.starts_with('#') {
            let name = t.split(['=', '.', ' ']).next().unwrap_or("").trim();
            if !name.is_empty() {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

fn manifest(dir: &str) -> String {
    std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap()
}

#[test]
fn the_workspace_lists_every_crate_checked_here() {
    let ws = manifest(".");
    for (dir, _, _) in RANKS {
        assert!(ws.contains(&format!("\"{dir}\"")), "{dir} is not a workspace member");
    }
}

#[test]
fn crates_depend_downwards_only() {
    let rank: BTreeMap<&str, u32> = RANKS.iter().map(|(_, name, r)| (*name, *r)).collect();
    let mut bad = Vec::new();
    for (dir, name, r) in RANKS {
        let m = manifest(dir);
        for section in ["dependencies", "build-dependencies"] {
            for dep in section_deps(&m, section) {
                if let Some(&dr) = rank.get(dep.as_str()) {
                    if dr >= *r {
                        bad.push(format!("{name} (rank {r}) depends on {dep} (rank {dr})"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "dependencies must point down the layers:\n{}", bad.join("\n"));
}

#[test]
fn the_engine_has_no_server_cli_or_async_dependencies() {
    let deps = section_deps(&manifest("engine"), "dependencies");
    for forbidden in ["tonic", "axum", "clap", "prometheus", "tokio", "anyhow", "tandem-proto", "http"] {
        assert!(!deps.contains(forbidden), "engine/Cargo.toml depends on {forbidden}");
    }
    // The check itself reads what it thinks it reads.
    assert!(deps.contains("tandem-kernels") && deps.contains("thiserror"), "parsed: {deps:?}");
}

/// The workspace crates `name` links, directly or through other workspace crates (normal
/// dependencies only: what ends up in its library and binaries).
fn linked_crates(name: &str) -> BTreeSet<String> {
    let dir_of: BTreeMap<&str, &str> = RANKS.iter().map(|(dir, n, _)| (*n, *dir)).collect();
    let mut seen = BTreeSet::new();
    let mut todo = vec![name.to_owned()];
    while let Some(n) = todo.pop() {
        let Some(dir) = dir_of.get(n.as_str()) else { continue };
        for dep in section_deps(&manifest(dir), "dependencies") {
            if dir_of.contains_key(dep.as_str()) && seen.insert(dep.clone()) {
                todo.push(dep);
            }
        }
    }
    seen
}

#[test]
fn the_router_links_neither_the_engine_nor_the_transport() {
    let linked = linked_crates("tandem-router");
    for forbidden in ["tandem-engine", "tandem-transport", "tandem-kernels", "tandem-worker"] {
        assert!(!linked.contains(forbidden), "the router links {forbidden} (through {linked:?})");
    }
    // It reads models through the model crate, and the walk above follows edges.
    assert!(linked.contains("tandem-model") && linked.contains("tandem-serve"), "{linked:?}");
    assert!(linked_crates("tandem-decode").contains("tandem-engine"), "the walk reaches the engine");
}

#[test]
fn the_model_crate_is_nothing_numeric() {
    let deps = section_deps(&manifest("model"), "dependencies");
    for forbidden in ["tandem-kernels", "cudarc", "rayon", "tokio", "tonic", "tandem-proto"] {
        assert!(!deps.contains(forbidden), "model/Cargo.toml depends on {forbidden}");
    }
    assert!(deps.contains("tokenizers"), "parsed: {deps:?}");
}

/// Crates whose purpose is testing; they may depend on the test helpers.
const TEST_CRATES: &[&str] = &["tests/e2e", "tests/support"];

#[test]
fn test_helpers_are_dev_dependencies_only() {
    let mut bad = Vec::new();
    for (dir, name, _) in RANKS {
        if TEST_CRATES.contains(dir) {
            continue;
        }
        let m = manifest(dir);
        for section in ["dependencies", "build-dependencies"] {
            if section_deps(&m, section).contains("tandem-test-support") {
                bad.push(format!("{name}: tandem-test-support in [{section}] (dev-dependencies only)"));
            }
        }
    }
    // No library source carries what only tests need: skips, required prerequisites, GPU probes
    // for tests.
    for dir in LIBRARIES {
        for f in rust_files(&root().join(dir).join("src")) {
            let code = code_of(&std::fs::read_to_string(&f).unwrap());
            let raw = std::fs::read_to_string(&f).unwrap();
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            for needle in ["Prerequisite", "gpu_for_test", "skip_test", "default_model_for_test"] {
                if code.contains(needle) {
                    bad.push(format!("{rel}: {needle} (test helpers live in tests/support)"));
                }
            }
            for needle in ["TANDEM_REQUIRE_", "SKIPPED "] {
                if without_test_items(&raw).contains(needle) {
                    bad.push(format!("{rel}: {needle:?} (test helpers live in tests/support)"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(
        section_deps(&manifest("engine"), "dev-dependencies").contains("tandem-test-support"),
        "the engine's tests use the helpers as a dev-dependency"
    );
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A source file's code with comments dropped, string literals blanked, and every
/// `#[cfg(test)]` item removed (a test module or helper may import anything).
fn code_of(src: &str) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut kept = String::new();
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if !in_str && c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\\' {
                in_str = !in_str;
                kept.push('"');
            } else if !in_str {
                kept.push(c);
            }
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
            i += 1;
        }
        out.push_str(&kept);
        out.push('\n');
    }
    without_test_items(&out)
}

/// `code` less each `#[cfg(test)]` attribute and the item it guards: up to the `;` of an item
/// without a body (`mod tests;`), else through the `}` that closes its body.
fn without_test_items(code: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let mut out = String::new();
    let mut rest = code;
    while let Some(i) = rest.find(ATTR) {
        out.push_str(&rest[..i]);
        let item = &rest[i + ATTR.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (j, c) in item.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = j + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

#[test]
fn libraries_have_typed_errors_and_no_environment_writes() {
    let mut bad = Vec::new();
    for dir in LIBRARIES {
        for f in rust_files(&root().join(dir).join("src")) {
            if f.file_name().is_some_and(|n| n == "main.rs") || f.components().any(|c| c.as_os_str() == "bin")
            {
                continue;
            }
            let code = code_of(&std::fs::read_to_string(&f).unwrap());
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            if code.contains("anyhow") {
                bad.push(format!("{rel}: uses anyhow (library errors are thiserror enums)"));
            }
            if code.contains("set_var") || code.contains("remove_var") {
                bad.push(format!("{rel}: writes the process environment"));
            }
        }
        let deps = section_deps(&manifest(dir), "dependencies");
        let has_main = root().join(dir).join("src/main.rs").exists();
        if deps.contains("anyhow") && !has_main {
            bad.push(format!("{dir}/Cargo.toml: a library-only crate depends on anyhow"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The module a file defines, as a path from the crate root: `src/a.rs` and `src/a/mod.rs` are
/// `[a]`, `src/a/b.rs` is `[a, b]`, `src/lib.rs` and `src/main.rs` are `[]`.
fn module_of(src_dir: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src_dir).unwrap();
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The module paths `code` names through `crate::` and `super::`, resolved against `module` (the
/// file's own module), each as its first two segments. Brace groups (`crate::{a, b::c}`) count
/// every member.
fn referenced_paths(code: &str, module: &[String], is_mod_file: bool) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let text: String = bytes.iter().collect();
    for (prefix, base) in [
        ("crate::", Vec::new()),
        ("super::", {
            // `super` of `src/a/b.rs` is `[a]`; of `src/a/mod.rs` (module `[a]`) it is `[]`.
            let mut m = module.to_vec();
            if !is_mod_file || !m.is_empty() {
                m.pop();
            }
            m
        }),
    ] {
        let mut start = 0;
        while let Some(i) = text[start..].find(prefix) {
            let at = start + i;
            start = at + prefix.len();
            if at > 0 && is_ident(text[..at].chars().last().unwrap()) {
                continue; // e.g. `tandem_crate::`
            }
            let rest = &text[at + prefix.len()..];
            let mut groups = Vec::new();
            if let Some(inner) = rest.strip_prefix('{') {
                let mut depth = 1;
                let mut end = 0;
                for (j, c) in inner.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = j;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let mut depth = 0;
                let mut item = String::new();
                for c in inner[..end].chars() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => groups.push(std::mem::take(&mut item)),
                        _ => {}
                    }
                    item.push(c);
                }
                groups.push(item);
            } else {
                groups.push(rest.to_owned());
            }
            for g in groups {
                let g = g.trim_start_matches(',').trim();
                let segs: Vec<String> = g
                    .split("::")
                    .map(|s| s.chars().take_while(|&c| is_ident(c)).collect::<String>())
                    .take_while(|s| !s.is_empty() && s != "self" && s != "super")
                    .take(2)
                    .collect();
                let mut p = base.clone();
                p.extend(segs);
                if !p.is_empty()
                    && p.iter().all(|s| s.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_'))
                {
                    out.push(p);
                } else if let Some(first) =
                    p.first().filter(|s| s.chars().next().is_some_and(|c| c.is_ascii_lowercase()))
                {
                    // `crate::kv::KvError`: the module part is what matters.
                    out.push(vec![first.clone()]);
                    if let Some(second) =
                        p.get(1).filter(|s| s.chars().next().is_some_and(|c| c.is_ascii_lowercase()))
                    {
                        out.last_mut().unwrap().push(second.clone());
                    }
                }
            }
        }
    }
    out
}

/// Strongly connected components of more than one node (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct S<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(s: &mut S<'_>, v: &str) {
        s.index.insert(v.into(), s.next);
        s.low.insert(v.into(), s.next);
        s.next += 1;
        s.stack.push(v.into());
        s.on.insert(v.into());
        let succ: Vec<String> = s.edges.get(v).map(|e| e.iter().cloned().collect()).unwrap_or_default();
        for w in succ {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let l = s.low[&w].min(s.low[v]);
                s.low.insert(v.into(), l);
            } else if s.on.contains(&w) {
                let l = s.index[&w].min(s.low[v]);
                s.low.insert(v.into(), l);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(&w);
                comp.push(w.clone());
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
    let mut s = S {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Module graphs of one crate: between its top-level modules, and between the children of each
/// directory module. Edges to a module's own parent do not count (a `mod.rs` declares its children).
fn module_graphs(src_dir: &Path) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut graphs: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for f in rust_files(src_dir) {
        if f.components().any(|c| c.as_os_str() == "bin") {
            continue;
        }
        let module = module_of(src_dir, &f);
        if module.is_empty() {
            continue;
        }
        let is_mod = f.file_name().is_some_and(|n| n == "mod.rs");
        let code = code_of(&std::fs::read_to_string(&f).unwrap());
        for target in referenced_paths(&code, &module, is_mod) {
            if target[0] != module[0] {
                graphs
                    .entry(String::new())
                    .or_default()
                    .entry(module[0].clone())
                    .or_default()
                    .insert(target[0].clone());
            } else if module.len() >= 2 && target.len() >= 2 && module[1] != target[1] {
                graphs
                    .entry(module[0].clone())
                    .or_default()
                    .entry(module[1].clone())
                    .or_default()
                    .insert(target[1].clone());
            }
        }
    }
    graphs
}

#[test]
fn no_module_imports_itself_through_a_cycle() {
    let mut found = Vec::new();
    for (dir, _, _) in RANKS {
        let src = root().join(dir).join("src");
        for (scope, graph) in module_graphs(&src) {
            for c in cycles(&graph) {
                let at = if scope.is_empty() { format!("{dir}/src") } else { format!("{dir}/src/{scope}") };
                found.push(format!("{at}: {}", c.join(" <-> ")));
            }
        }
    }
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

#[test]
fn the_cycle_finder_finds_cycles() {
    // A graph with a known cycle and a known acyclic part, so the check above can fail.
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("backend", "cpu"), ("cpu", "backend"), ("cpu", "kv"), ("kv", "error")] {
        g.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(cycles(&g), vec![vec!["backend".to_string(), "cpu".to_string()]]);

    let code = code_of(
        "use crate::{backend::Backend, kv::{BlockId, KvError}};\nuse super::pool::X; // crate::nope\nlet s = \"crate::no\";\n",
    );
    let refs = referenced_paths(&code, &["kv".into(), "shm".into()], false);
    assert!(
        refs.contains(&vec!["backend".into(), "Backend".into()]) || refs.contains(&vec!["backend".into()]),
        "{refs:?}"
    );
    assert!(refs.iter().any(|r| r[0] == "kv"), "{refs:?}");
    assert!(refs.contains(&vec!["kv".into(), "pool".into()]), "{refs:?}");
    assert!(
        !refs.iter().any(|r| r[0] == "nope" || r[0] == "no"),
        "comments and strings are not code: {refs:?}"
    );

    let code = code_of(
        "#[cfg(test)]\nmod tests;\nuse crate::a::X;\n#[cfg(test)]\nfn helper() { if x { crate::b::y() } }\n\
         fn real() { crate::c::z() }\n#[cfg(test)]\nmod t {\n    use anyhow::Result;\n}\n",
    );
    assert!(
        code.contains("crate::a::X") && code.contains("crate::c::z"),
        "code after a test item is kept: {code}"
    );
    assert!(!code.contains("crate::b") && !code.contains("anyhow") && !code.contains("mod tests"), "{code}");
}

#[test]
fn the_transport_knows_no_protobuf() {
    // The transport's API speaks its own types (destination, offer, counters); the worker
    // services convert at their wire edge (`worker/src/kv_wire.rs`).
    let m = manifest("transport");
    let mut bad = Vec::new();
    for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if section_deps(&m, section).contains("tandem-proto") {
            bad.push(format!("transport/Cargo.toml: [{section}] lists tandem-proto"));
        }
    }
    // Any section, including target-specific ones the section reader above does not name.
    if m.lines().any(|l| l.trim_start().starts_with("tandem-proto")) {
        bad.push("transport/Cargo.toml: names tandem-proto".into());
    }
    let mut stack = vec![root().join("transport")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    stack.push(p);
                }
            } else if std::fs::read_to_string(&p).is_ok_and(|s| s.contains("tandem_proto")) {
                bad.push(format!("{}: mentions tandem_proto", p.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Text is made where it is shown: the model crate's `text` module composes the detokenizer and
/// the stop strings once, and only the router's output shaping and the engine's in-process
/// `generate` run it. Workers (and the rest of the engine) deal in token ids.
#[test]
fn only_the_edge_turns_tokens_into_text() {
    const ALLOWED: [&str; 3] =
        ["model/src/text.rs", "router/src/orchestrate/output.rs", "engine/src/scheduler/generate.rs"];
    let mut bad = Vec::new();
    let mut users = BTreeSet::new();
    for dir in LIBRARIES {
        for f in rust_files(&root().join(dir).join("src")) {
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            let code = code_of(&std::fs::read_to_string(&f).unwrap());
            if rel.starts_with("model/src/tokenizer") || rel == "model/src/stop.rs" {
                continue; // where the pieces are defined
            }
            for piece in ["IncrementalDecoder", "StopStrings", "TextOutput"] {
                if code.contains(piece) {
                    if ALLOWED.contains(&rel.as_str()) {
                        users.insert(rel.clone());
                    } else {
                        bad.push(format!("{rel}: uses {piece} (only {ALLOWED:?} make text)"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    // The check looks at real files: each allowed one exists and makes text.
    assert_eq!(users.len(), ALLOWED.len(), "text made in {users:?}");
}

#[test]
fn no_file_points_outside_the_repository() {
    // The repository carries its own design (docs/design.md): a clone has nothing beside it, so
    // no file may send a reader to a sibling `shared` folder. The needles are built from pieces so
    // that this file does not match itself.
    let needles = [concat!("..", "/shared"), concat!("shared/", "DESIGN.md")];

    /// The files git tracks, or, outside a git checkout (an unpacked archive), every file under
    /// `root` except build output and hidden folders.
    fn tracked_files(root: &Path) -> Vec<PathBuf> {
        let git = std::process::Command::new("git").args(["ls-files", "-z"]).current_dir(root).output();
        if let Ok(out) = git {
            if out.status.success() && !out.stdout.is_empty() {
                return out
                    .stdout
                    .split(|&b| b == 0)
                    .filter(|p| !p.is_empty())
                    .map(|p| root.join(String::from_utf8_lossy(p).as_ref()))
                    .collect();
            }
        }
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
                if p.is_dir() {
                    if !name.starts_with('.') && !(d == root && (name == "target" || name == "models")) {
                        stack.push(p);
                    }
                } else {
                    out.push(p);
                }
            }
        }
        out
    }

    let root = root();
    let files = tracked_files(&root);
    let mut checked = 0;
    let mut bad = Vec::new();
    for file in &files {
        // A file deleted in the working tree but still in the index is not there to point anywhere.
        let Ok(bytes) = std::fs::read(file) else { continue };
        // Text only: binary fixtures (weights, archives) may contain any bytes.
        if bytes.contains(&0) {
            continue;
        }
        let Ok(text) = std::str::from_utf8(&bytes) else { continue };
        checked += 1;
        for (n, line) in text.lines().enumerate() {
            if needles.iter().any(|needle| line.contains(needle)) {
                let rel = file.strip_prefix(&root).unwrap_or(file);
                bad.push(format!("{}:{}: {}", rel.display(), n + 1, line.trim()));
            }
        }
    }
    // The listing saw the repository's text, this file and the design among it.
    let seen = |p: &str| files.iter().any(|f| f.ends_with(p));
    assert!(
        checked > 100 && seen("tests/e2e/tests/layering.rs") && seen("docs/design.md"),
        "only {checked} text files found under {}",
        root.display()
    );
    assert!(bad.is_empty(), "files pointing outside the repository:\n{}", bad.join("\n"));
}

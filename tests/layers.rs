//! The crate's top-level modules form layers that import downward only (`src/lib.rs`,
//! `docs/ARCHITECTURE.md`). This reads every source file under `src/` and fails on an import of a
//! module from the same or a higher layer, which is also how a cycle would start.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

/// Bottom first. A module may use the modules of the layers before its own, never its own
/// layer's others or a later one.
const LAYERS: &[&[&str]] = &[
    &["model", "stop", "report", "client"],
    &["config"],
    &["metrics", "pod"],
    &["sse"],
    &["backend"],
    &["replay"],
    &["stream"],
    &["actors"],
    &["http"],
    &["hub"],
    &["loadtest"],
    &["cli"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// The top-level modules named by `crate::` paths in `source`, comments left out:
/// `crate::a::b`, `crate::{a::b, c}` and `crate::{a, b::{c, d}}` all count.
fn crate_imports(source: &str) -> BTreeSet<String> {
    let code: String = source
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The names at depth one of the braces, each up to its first `::`.
            let (mut depth, mut name, mut end) = (1, String::new(), group.len());
            for (index, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = index;
                    break;
                }
                if depth == 1 && c == ',' {
                    found.insert(first_segment(&name));
                    name.clear();
                } else if depth >= 1 {
                    name.push(c);
                }
            }
            found.insert(first_segment(&name));
            rest = &group[end..];
        } else {
            found.insert(first_segment(rest));
        }
    }
    found.retain(|name| !name.is_empty());
    found
}

fn first_segment(path: &str) -> String {
    path.trim_start_matches(|c: char| c.is_whitespace() || c == '{')
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// Every `crate::` import in `src/` goes to a lower layer, and every module has a layer.
#[test]
fn modules_import_only_from_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let top = relative
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if top == "lib" || top == "main" {
            continue;
        }
        let Some(own) = layer_of(&top) else {
            violations.push(format!(
                "{}: module `{top}` has no layer",
                relative.display()
            ));
            continue;
        };
        for import in crate_imports(&fs::read_to_string(&file).unwrap()) {
            if import == top {
                continue;
            }
            match layer_of(&import) {
                Some(layer) if layer < own => {}
                Some(_) => violations.push(format!(
                    "{}: `{top}` imports `{import}`, which is not below it",
                    relative.display()
                )),
                None => violations.push(format!(
                    "{}: `{top}` imports `{import}`, which has no layer",
                    relative.display()
                )),
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// The reader of imports finds what the layer check must see.
#[test]
fn imports_are_read_from_every_form_of_use() {
    let source = "use crate::model::DeviceId;\n\
                  use crate::{metrics::Metrics, pod::{self, PodState}, sse};\n\
                  // use crate::http::Commented;\n\
                  fn f() { crate::stop::sleep_or_stop(); }\n";
    let found: Vec<String> = crate_imports(source).into_iter().collect();
    assert_eq!(found, ["metrics", "model", "pod", "sse", "stop"]);
}

//! The crate's top-level modules form layers that import downward only (`src/lib.rs`,
//! `docs/ARCHITECTURE.md`). This reads every source file under `src/` and fails on an import of a
//! module from the same or a higher layer, which is also how a cycle would start. It also reads
//! `Cargo.lock` to check that the client crate stays free of the hub's dependencies.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// Bottom first. A module may use the modules of the layers before its own, never its own
/// layer's others or a later one.
const LAYERS: &[&[&str]] = &[
    &["model", "stop", "report", "tls"],
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

/// Every package `root` depends on, directly or not, by name (from `Cargo.lock`, which lists
/// normal, build and dev dependencies alike).
fn dependency_closure(lock: &str, root: &str) -> BTreeSet<String> {
    let lock: toml::Table = lock.parse().expect("Cargo.lock is TOML");
    let packages = lock["package"]
        .as_array()
        .expect("Cargo.lock lists packages");
    // "name version" -> dependencies as written ("name" or "name version ...").
    let mut by_id: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut versions: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for package in packages {
        let name = package["name"].as_str().unwrap().to_owned();
        let version = package["version"].as_str().unwrap().to_owned();
        let dependencies = package
            .get("dependencies")
            .and_then(|d| d.as_array())
            .map(|d| d.iter().map(|d| d.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default();
        by_id.insert(format!("{name} {version}"), dependencies);
        versions.entry(name).or_default().push(version);
    }
    let resolve = |reference: &str| -> String {
        let mut parts = reference.split(' ');
        let name = parts.next().unwrap();
        match parts.next() {
            Some(version) => format!("{name} {version}"),
            None => format!("{name} {}", versions[name][0]),
        }
    };
    let mut seen = BTreeSet::new();
    let mut todo = vec![resolve(root)];
    while let Some(id) = todo.pop() {
        if seen.insert(id.clone()) {
            todo.extend(by_id[&id].iter().map(|d| resolve(d)));
        }
    }
    seen.into_iter()
        .map(|id| id.split(' ').next().unwrap().to_owned())
        .collect()
}

/// A Rust POS application can depend on `posthorn-client` without compiling actix, fred or
/// async-nats: none of them is in the client crate's dependency tree (and all are in the hub's,
/// so the reading of `Cargo.lock` is not what makes this pass).
#[test]
fn the_client_crate_pulls_in_no_hub_dependency() {
    let lock =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.lock")).unwrap();
    let heavy = |closure: &BTreeSet<String>| -> Vec<String> {
        closure
            .iter()
            .filter(|name| name.starts_with("actix") || *name == "fred" || *name == "async-nats")
            .cloned()
            .collect()
    };
    let hub = heavy(&dependency_closure(&lock, "posthorn"));
    for name in ["actix", "actix-web", "fred", "async-nats"] {
        assert!(hub.iter().any(|h| h == name), "the hub depends on {name}");
    }
    let client = heavy(&dependency_closure(&lock, "posthorn-client"));
    assert!(client.is_empty(), "posthorn-client depends on {client:?}");
}

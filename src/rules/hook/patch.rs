//! RFC 6902 JSON Patch on a `serde_json::Value`: the six operations, all or none.
//!
//! Written here (about a hundred lines) rather than taken as a crate: the crates
//! that do it bring their own JSON Pointer and error types, and a hook's patch only
//! needs these six operations over the `Value` the decision is already parsed into.

use serde_json::Value;

/// Why a patch could not be applied (the hook's answer is then an error, handled by
/// its `on_error`).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum PatchError {
    #[error("patch must be an array of operations")]
    NotAnArray,
    #[error("patch operation {index}: {error}")]
    Operation {
        index: usize,
        error: Box<PatchError>,
    },
    #[error("has no {0:?}")]
    Missing(&'static str),
    #[error("{0:?} must be a string")]
    NotAString(&'static str),
    #[error("nothing at {path:?} to {op}")]
    Nothing { path: String, op: &'static str },
    #[error("test failed at {0:?}")]
    TestFailed(String),
    #[error("cannot move {from:?} into its own child {path:?}")]
    IntoOwnChild { from: String, path: String },
    #[error("unknown op {0:?}")]
    UnknownOp(String),
    #[error("{0:?} is not a JSON pointer")]
    NotAPointer(String),
    #[error("the parent of {0:?} is not a container")]
    NotAContainer(String),
    #[error("the parent of {0:?} does not exist")]
    NoParent(String),
    #[error("cannot remove the whole document")]
    WholeDocument,
    #[error("{token:?} is not an index below {len}")]
    BadIndex { token: String, len: usize },
}

/// Applies `ops` (a JSON array of operations) to `doc` in order; on the first
/// failing operation `doc` is left unchanged and the reason is returned. Returns
/// the paths changed, as JSON pointers, in order.
pub(crate) fn apply(doc: &mut Value, ops: &Value) -> Result<Vec<String>, PatchError> {
    let Value::Array(ops) = ops else {
        return Err(PatchError::NotAnArray);
    };
    let mut work = doc.clone();
    let mut changed = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        one(&mut work, op, &mut changed).map_err(|e| PatchError::Operation {
            index: i,
            error: Box::new(e),
        })?;
    }
    *doc = work;
    Ok(changed)
}

fn field<'v>(op: &'v Value, name: &'static str) -> Result<&'v Value, PatchError> {
    op.get(name).ok_or(PatchError::Missing(name))
}

fn path_of<'v>(op: &'v Value, name: &'static str) -> Result<&'v str, PatchError> {
    field(op, name)?
        .as_str()
        .ok_or(PatchError::NotAString(name))
}

fn nothing(path: &str, op: &'static str) -> PatchError {
    PatchError::Nothing {
        path: path.to_owned(),
        op,
    }
}

fn one(doc: &mut Value, op: &Value, changed: &mut Vec<String>) -> Result<(), PatchError> {
    let kind = path_of(op, "op")?;
    let path = path_of(op, "path")?;
    match kind {
        "add" => {
            add(doc, path, field(op, "value")?.clone())?;
            changed.push(path.to_owned());
        }
        "remove" => {
            remove(doc, path)?;
            changed.push(path.to_owned());
        }
        "replace" => {
            let target = doc
                .pointer_mut(path)
                .ok_or_else(|| nothing(path, "replace"))?;
            *target = field(op, "value")?.clone();
            changed.push(path.to_owned());
        }
        "test" => {
            let found = doc.pointer(path).ok_or_else(|| nothing(path, "test"))?;
            if found != field(op, "value")? {
                return Err(PatchError::TestFailed(path.to_owned()));
            }
        }
        "move" => {
            let from = path_of(op, "from")?;
            if path.starts_with(from) && path[from.len()..].starts_with('/') {
                return Err(PatchError::IntoOwnChild {
                    from: from.to_owned(),
                    path: path.to_owned(),
                });
            }
            let value = remove(doc, from)?;
            add(doc, path, value)?;
            changed.push(from.to_owned());
            changed.push(path.to_owned());
        }
        "copy" => {
            let from = path_of(op, "from")?;
            let value = doc
                .pointer(from)
                .ok_or_else(|| nothing(from, "copy"))?
                .clone();
            add(doc, path, value)?;
            changed.push(path.to_owned());
        }
        other => return Err(PatchError::UnknownOp(other.to_owned())),
    }
    Ok(())
}

/// Splits a pointer into its parent and its last token (unescaped).
fn split(path: &str) -> Result<(&str, String), PatchError> {
    if path.is_empty() {
        return Ok(("", String::new()));
    }
    if !path.starts_with('/') {
        return Err(PatchError::NotAPointer(path.to_owned()));
    }
    let at = path.rfind('/').unwrap_or(0);
    let last = path[at + 1..].replace("~1", "/").replace("~0", "~");
    Ok((&path[..at], last))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), PatchError> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = split(path)?;
    match doc.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.insert(last, value);
            Ok(())
        }
        Some(Value::Array(items)) => {
            let at = if last == "-" {
                items.len()
            } else {
                index(&last, items.len() + 1)?
            };
            items.insert(at, value);
            Ok(())
        }
        Some(_) => Err(PatchError::NotAContainer(path.to_owned())),
        None => Err(PatchError::NoParent(path.to_owned())),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, PatchError> {
    let (parent, last) = split(path)?;
    if path.is_empty() {
        return Err(PatchError::WholeDocument);
    }
    match doc.pointer_mut(parent) {
        Some(Value::Object(map)) => map
            .shift_remove(&last)
            .ok_or_else(|| nothing(path, "remove")),
        Some(Value::Array(items)) => {
            let at = index(&last, items.len())?;
            Ok(items.remove(at))
        }
        _ => Err(nothing(path, "remove")),
    }
}

/// An array index token below `len`, without leading zeros.
fn index(token: &str, len: usize) -> Result<usize, PatchError> {
    let bad = || PatchError::BadIndex {
        token: token.to_owned(),
        len,
    };
    if token.len() > 1 && token.starts_with('0') {
        return Err(bad());
    }
    match token.parse::<usize>() {
        Ok(i) if i < len => Ok(i),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_six_operations_apply_in_order() {
        let mut doc = json!({"a": 1, "list": [1, 2], "obj": {"x": "y"}});
        let ops = json!([
            {"op": "test", "path": "/a", "value": 1},
            {"op": "replace", "path": "/a", "value": 2},
            {"op": "add", "path": "/list/-", "value": 3},
            {"op": "add", "path": "/list/0", "value": 0},
            {"op": "remove", "path": "/list/1"},
            {"op": "copy", "from": "/obj", "path": "/copied"},
            {"op": "move", "from": "/obj/x", "path": "/moved"},
            {"op": "add", "path": "/a~1b", "value": true}
        ]);
        let changed = apply(&mut doc, &ops).expect("applies");
        assert_eq!(
            doc,
            json!({"a": 2, "list": [0, 2, 3], "obj": {}, "copied": {"x": "y"}, "moved": "y", "a/b": true})
        );
        assert!(changed.contains(&"/moved".to_owned()));
    }

    #[test]
    fn a_failing_operation_leaves_the_document_unchanged() {
        let mut doc = json!({"a": 1});
        let ops = json!([
            {"op": "replace", "path": "/a", "value": 2},
            {"op": "test", "path": "/a", "value": 1}
        ]);
        let err = apply(&mut doc, &ops).expect_err("the test fails");
        assert_eq!(
            err,
            PatchError::Operation {
                index: 1,
                error: Box::new(PatchError::TestFailed("/a".into()))
            }
        );
        assert_eq!(err.to_string(), "patch operation 1: test failed at \"/a\"");
        assert_eq!(doc, json!({"a": 1}));
        assert!(apply(&mut doc, &json!([{"op": "remove", "path": "/nope"}])).is_err());
        assert!(apply(&mut doc, &json!([{"op": "frob", "path": "/a"}])).is_err());
        assert!(apply(&mut doc, &json!({"op": "add"})).is_err());
    }
}

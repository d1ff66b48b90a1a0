//! RFC 6902 JSON Patch on a `serde_json::Value`: the six operations, all or none.
//!
//! Written here (about a hundred lines) rather than taken as a crate: the crates
//! that do it bring their own JSON Pointer and error types, and a hook's patch only
//! needs these six operations over the `Value` the decision is already parsed into.

use serde_json::Value;

/// Applies `ops` (a JSON array of operations) to `doc` in order; on the first
/// failing operation `doc` is left unchanged and the reason is returned. Returns
/// the paths changed, as JSON pointers, in order.
pub(crate) fn apply(doc: &mut Value, ops: &Value) -> Result<Vec<String>, String> {
    let Value::Array(ops) = ops else {
        return Err("patch must be an array of operations".into());
    };
    let mut work = doc.clone();
    let mut changed = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        one(&mut work, op, &mut changed).map_err(|e| format!("patch operation {i}: {e}"))?;
    }
    *doc = work;
    Ok(changed)
}

fn field<'v>(op: &'v Value, name: &str) -> Result<&'v Value, String> {
    op.get(name).ok_or_else(|| format!("has no {name:?}"))
}

fn path_of<'v>(op: &'v Value, name: &str) -> Result<&'v str, String> {
    field(op, name)?
        .as_str()
        .ok_or_else(|| format!("{name:?} must be a string"))
}

fn one(doc: &mut Value, op: &Value, changed: &mut Vec<String>) -> Result<(), String> {
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
                .ok_or_else(|| format!("nothing at {path:?} to replace"))?;
            *target = field(op, "value")?.clone();
            changed.push(path.to_owned());
        }
        "test" => {
            let found = doc
                .pointer(path)
                .ok_or_else(|| format!("nothing at {path:?} to test"))?;
            if found != field(op, "value")? {
                return Err(format!("test failed at {path:?}"));
            }
        }
        "move" => {
            let from = path_of(op, "from")?;
            if path.starts_with(from) && path[from.len()..].starts_with('/') {
                return Err(format!("cannot move {from:?} into its own child {path:?}"));
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
                .ok_or_else(|| format!("nothing at {from:?} to copy"))?
                .clone();
            add(doc, path, value)?;
            changed.push(path.to_owned());
        }
        other => return Err(format!("unknown op {other:?}")),
    }
    Ok(())
}

/// Splits a pointer into its parent and its last token (unescaped).
fn split(path: &str) -> Result<(&str, String), String> {
    if path.is_empty() {
        return Ok(("", String::new()));
    }
    if !path.starts_with('/') {
        return Err(format!("{path:?} is not a JSON pointer"));
    }
    let at = path.rfind('/').unwrap_or(0);
    let last = path[at + 1..].replace("~1", "/").replace("~0", "~");
    Ok((&path[..at], last))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
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
        Some(_) => Err(format!("the parent of {path:?} is not a container")),
        None => Err(format!("the parent of {path:?} does not exist")),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, last) = split(path)?;
    if path.is_empty() {
        return Err("cannot remove the whole document".into());
    }
    match doc.pointer_mut(parent) {
        Some(Value::Object(map)) => map
            .shift_remove(&last)
            .ok_or_else(|| format!("nothing at {path:?} to remove")),
        Some(Value::Array(items)) => {
            let at = index(&last, items.len())?;
            Ok(items.remove(at))
        }
        _ => Err(format!("nothing at {path:?} to remove")),
    }
}

/// An array index token below `len`, without leading zeros.
fn index(token: &str, len: usize) -> Result<usize, String> {
    let bad = || format!("{token:?} is not an index below {len}");
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
        assert!(err.contains("operation 1"), "{err}");
        assert_eq!(doc, json!({"a": 1}));
        assert!(apply(&mut doc, &json!([{"op": "remove", "path": "/nope"}])).is_err());
        assert!(apply(&mut doc, &json!([{"op": "frob", "path": "/a"}])).is_err());
        assert!(apply(&mut doc, &json!({"op": "add"})).is_err());
    }
}

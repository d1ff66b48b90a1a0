//! JSON pointers, and the operations rules run at one (json.set / json.remove / json.append).

use crate::provider::json;
use serde_json::Value;

use super::Node;
use super::peek::array_index;

/// Why a JSON pointer does not read, or an edit at one cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PointerError {
    #[error(
        "invalid JSON pointer {0:?}: it must start with \"/\" (expected e.g. \"/metadata/user_id\")"
    )]
    NoSlash(String),
    #[error(
        "invalid JSON pointer {0:?}: \"~\" must be followed by 0 or 1 (\"~0\" is ~, \"~1\" is /)"
    )]
    BadEscape(String),
    #[error("cannot {0} the whole body")]
    WholeBody(&'static str),
    #[error("{0} does not exist")]
    Missing(String),
    #[error("{0} is not an object or array")]
    NotContainer(String),
    #[error("{parent} has no index {index:?}")]
    NoIndex { parent: String, index: String },
    #[error("{0} is not an array")]
    NotArray(String),
}

/// An RFC 6901 JSON pointer, split into unescaped tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pointer(pub(crate) Vec<String>);

impl Pointer {
    /// Parses `""`, `"/a/0"`, `"/a~1b/c~0d"`.
    pub(crate) fn parse(text: &str) -> Result<Pointer, PointerError> {
        if text.is_empty() {
            return Ok(Pointer(Vec::new()));
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(PointerError::NoSlash(text.to_owned()));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    token.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => token.push('~'),
                    Some('1') => token.push('/'),
                    _ => {
                        return Err(PointerError::BadEscape(text.to_owned()));
                    }
                }
            }
            tokens.push(token);
        }
        Ok(Pointer(tokens))
    }

    /// The pointer text of `tokens`.
    pub(crate) fn text(tokens: &[String]) -> String {
        json::pointer_text(tokens)
    }
}

impl std::fmt::Display for Pointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&Pointer::text(&self.0))
    }
}

/// Pointer tokens from string and index parts: `ptr!["messages", 3, "content"]`
/// (an array; `Vec::from` makes it a list without copying the tokens).
macro_rules! ptr {
    ($($part:expr),* $(,)?) => { [$($part.to_string()),*] };
}
pub(crate) use ptr;

// === pointer operations (json.set / json.remove / json.append) ===

/// Sets the value at `tokens` (RFC 6901; `-` or the length appends to an array).
/// The parent must exist.
pub(crate) fn set(
    root: &mut Node<'_>,
    tokens: &[String],
    value: Value,
) -> Result<(), PointerError> {
    let Some((last, parent)) = tokens.split_last() else {
        return Err(PointerError::WholeBody("replace"));
    };
    let missing = || PointerError::Missing(Pointer::text(parent));
    let Some(node) = root.at(parent) else {
        return Err(missing());
    };
    if node.is_object() {
        root.at_mut(parent)
            .ok_or_else(missing)?
            .set_key(last, Node::Value(value));
        return Ok(());
    }
    let Some(len) = node.len() else {
        return Err(PointerError::NotContainer(Pointer::text(parent)));
    };
    let index = if last == "-" {
        len
    } else {
        array_index(last)
            .filter(|i| *i <= len)
            .ok_or_else(|| PointerError::NoIndex {
                parent: Pointer::text(parent),
                index: last.clone(),
            })?
    };
    let node = root.at_mut(parent).ok_or_else(missing)?;
    if index == len {
        node.insert(index, Node::Value(value));
    } else if let Some(items) = node.items() {
        items[index] = Node::Value(value);
    }
    Ok(())
}

/// Removes the value at `tokens`; `Ok(false)` when there was nothing to remove.
pub(crate) fn remove(root: &mut Node<'_>, tokens: &[String]) -> Result<bool, PointerError> {
    let Some((last, parent)) = tokens.split_last() else {
        return Err(PointerError::WholeBody("remove"));
    };
    let Some(node) = root.at(parent) else {
        return Ok(false);
    };
    if node.is_object() {
        if !node.has(last) {
            return Ok(false);
        }
        return Ok(root.at_mut(parent).is_some_and(|n| n.remove_key(last)));
    }
    match (node.len(), array_index(last)) {
        (Some(len), Some(i)) if i < len => {
            Ok(root.at_mut(parent).is_some_and(|n| n.remove_index(i)))
        }
        _ => Ok(false),
    }
}

/// Appends `value` to the array at `tokens`, creating `[value]` there when it is
/// missing and its parent is an object.
pub(crate) fn append(
    root: &mut Node<'_>,
    tokens: &[String],
    value: Value,
) -> Result<(), PointerError> {
    match root.at(tokens) {
        Some(node) if node.is_array() => {
            if let Some(node) = root.at_mut(tokens) {
                node.insert(usize::MAX, Node::Value(value));
            }
            Ok(())
        }
        Some(_) => Err(PointerError::NotArray(Pointer::text(tokens))),
        None => set(root, tokens, Value::Array(vec![value])),
    }
}

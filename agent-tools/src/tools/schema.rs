//! The advertised form of a tool's argument schema: schemars' output with what repeats or
//! tells a model nothing taken out. The schemas go into every episode's first prompt (and
//! MCP's `tools/list`), so each byte is paid once per episode by every agent.
//!
//! What goes: the root's description (the tool's own description says it), `"default": null`
//! and the `null` in `[T, "null"]` of optional fields (a field is optional by not being
//! `required`; the parser still takes a null), integer `format`s (`uint64`: `minimum` says
//! what matters), `$ref`s into `$defs` (each definition inlined where it is used, its own
//! description dropped where the field describes itself) and a `oneOf` of string constants
//! (an `enum` of their values: the field's description says what they mean).

use serde_json::{Map, Value};

/// `schema` (a tool's parameters, as schemars makes them) in its advertised form.
pub fn compact(mut schema: Value) -> Value {
    let defs = schema
        .as_object_mut()
        .and_then(|m| m.remove("$defs"))
        .and_then(|d| match d {
            Value::Object(m) => Some(m),
            _ => None,
        })
        .unwrap_or_default();
    if let Some(root) = schema.as_object_mut() {
        root.remove("description");
    }
    simplify(&mut schema, &defs, 0);
    schema
}

/// Deepest nesting of inlined definitions followed: the argument types are not recursive,
/// and a recursive one would otherwise inline forever.
const MAX_DEPTH: usize = 8;

/// One schema node, then the schemas inside it (a `properties` map's values are schemas, the
/// map itself is not: a field may be named `format`).
fn simplify(node: &mut Value, defs: &Map<String, Value>, depth: usize) {
    let Value::Object(map) = node else {
        return;
    };
    inline_ref(map, defs, depth);
    optional_as_plain(map);
    constants_as_enum(map);
    map.remove("format");
    if map.get("default") == Some(&Value::Null) {
        map.remove("default");
    }
    if let Some(Value::Object(props)) = map.get_mut("properties") {
        props
            .values_mut()
            .for_each(|p| simplify(p, defs, depth + 1));
    }
    for key in ["items", "additionalProperties"] {
        if let Some(sub) = map.get_mut(key) {
            simplify(sub, defs, depth + 1);
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(subs)) = map.get_mut(key) {
            subs.iter_mut().for_each(|s| simplify(s, defs, depth + 1));
        }
    }
}

/// `{"$ref": "#/$defs/X", ...}` or `{"anyOf": [{"$ref": ...}, {"type": "null"}], ...}`
/// becomes X's schema with the node's own keys over it.
fn inline_ref(map: &mut Map<String, Value>, defs: &Map<String, Value>, depth: usize) {
    if depth > MAX_DEPTH {
        return;
    }
    let target = match (map.get("$ref"), map.get("anyOf")) {
        (Some(Value::String(r)), _) => Some(r.clone()),
        (None, Some(Value::Array(any))) if any.len() == 2 => {
            let is_null = |v: &Value| v.get("type") == Some(&Value::String("null".into()));
            match (&any[0], &any[1]) {
                (r, n) | (n, r) if is_null(n) => {
                    r.get("$ref").and_then(Value::as_str).map(str::to_string)
                }
                _ => None,
            }
        }
        _ => None,
    };
    let Some(def) = target
        .as_deref()
        .and_then(|r| r.strip_prefix("#/$defs/"))
        .and_then(|name| defs.get(name))
        .and_then(Value::as_object)
    else {
        return;
    };
    map.remove("$ref");
    map.remove("anyOf");
    for (key, value) in def {
        if key == "description" && map.contains_key("description") {
            continue;
        }
        map.entry(key.clone()).or_insert_with(|| value.clone());
    }
}

/// `"type": [T, "null"]` becomes `"type": T`.
fn optional_as_plain(map: &mut Map<String, Value>) {
    let Some(Value::Array(types)) = map.get("type") else {
        return;
    };
    let kept: Vec<&Value> = types
        .iter()
        .filter(|t| t.as_str() != Some("null"))
        .collect();
    if kept.len() == 1 && types.len() == 2 {
        let only = kept[0].clone();
        map.insert("type".into(), only);
    }
}

/// `"oneOf": [{"const": "a", "type": "string"}, ...]` becomes `"type": "string", "enum": ["a", ...]`.
fn constants_as_enum(map: &mut Map<String, Value>) {
    let Some(Value::Array(variants)) = map.get("oneOf") else {
        return;
    };
    let values: Option<Vec<Value>> = variants
        .iter()
        .map(
            |v| match (v.get("const"), v.get("type").and_then(Value::as_str)) {
                (Some(c @ Value::String(_)), Some("string")) => Some(c.clone()),
                _ => None,
            },
        )
        .collect();
    let Some(values) = values.filter(|v| !v.is_empty()) else {
        return;
    };
    map.remove("oneOf");
    map.insert("type".into(), Value::String("string".into()));
    map.insert("enum".into(), Value::Array(values));
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn optional_fields_refs_and_constants_are_compacted() {
        let schema = json!({
            "description": "Arguments of `X`.",
            "type": "object",
            "properties": {
                "n": {"default": null, "description": "How many.", "format": "uint64", "minimum": 0, "type": ["integer", "null"]},
                "mode": {"anyOf": [{"$ref": "#/$defs/Mode"}, {"type": "null"}], "default": null, "description": "`a` or `b`."},
                "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}
            },
            "required": [],
            "$defs": {
                "Mode": {"description": "What X does.", "oneOf": [
                    {"const": "a", "description": "A.", "type": "string"},
                    {"const": "b", "description": "B.", "type": "string"}]},
                "Item": {"description": "One item.", "type": "object", "properties": {"k": {"type": "string"}}}
            }
        });
        assert_eq!(
            compact(schema),
            json!({
                "type": "object",
                "properties": {
                    "n": {"description": "How many.", "minimum": 0, "type": "integer"},
                    "mode": {"description": "`a` or `b`.", "type": "string", "enum": ["a", "b"]},
                    "items": {"type": "array", "items": {"description": "One item.", "type": "object", "properties": {"k": {"type": "string"}}}}
                },
                "required": []
            })
        );
    }

    #[test]
    fn what_it_does_not_know_is_left_as_it_is() {
        let schema = json!({
            "type": "object",
            "properties": {
                "either": {"type": ["integer", "string"]},
                "mixed": {"oneOf": [{"const": 1, "type": "integer"}, {"const": "a", "type": "string"}]},
                "dangling": {"$ref": "#/$defs/Missing"},
                "default": {"default": false, "type": "boolean"},
                "format": {"type": "string"}
            }
        });
        assert_eq!(compact(schema.clone()), schema);
    }
}

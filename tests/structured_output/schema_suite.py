"""Thirty-two JSON schemas for end-to-end constrained-decoding tests, each paired with a prompt.

They cover the features agents use: nested objects, arrays with bounds, enums, anyOf/oneOf,
$ref/$defs, string patterns and formats, numbers with ranges, const, required vs optional
fields, nullable values and closed objects. Bounds on every string and array keep a small
model's output finite, as a real schema for an agent's tool would.
"""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, str, dict]] = [
    ("flat_person", "Describe a person.", {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("enum_color", "What is the color of the sky?", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "grey"]}},
        "required": ["color"], "additionalProperties": False}),
    ("bool_flag", "Is water wet?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}, "reason": SHORT},
        "required": ["answer"], "additionalProperties": False}),
    ("number_range", "Give a temperature in Celsius for a warm day.", {
        "type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                                                     "maximum": 60}},
        "required": ["celsius"], "additionalProperties": False}),
    ("int_exclusive", "Give a dice roll.", {
        "type": "object", "properties": {"roll": {"type": "integer", "exclusiveMinimum": 0,
                                                  "exclusiveMaximum": 7}},
        "required": ["roll"], "additionalProperties": False}),
    ("array_bounded", "List three fruits.", {
        "type": "object", "properties": {"fruits": {"type": "array", "items": NAME,
                                                    "minItems": 1, "maxItems": 3}},
        "required": ["fruits"], "additionalProperties": False}),
    ("array_of_ints", "List some prime numbers.", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000},
        "minItems": 2, "maxItems": 5}),
    ("nested_address", "Describe where a company is.", {
        "type": "object", "properties": {
            "company": NAME,
            "address": {"type": "object", "properties": {
                "street": SHORT, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["company", "address"], "additionalProperties": False}),
    ("pattern_code", "Give a product code.", {
        "type": "object", "properties": {"code": {"type": "string",
                                                  "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
        "required": ["code"], "additionalProperties": False}),
    ("format_date", "When did the event happen?", {
        "type": "object", "properties": {"date": {"type": "string", "format": "date"}},
        "required": ["date"], "additionalProperties": False}),
    ("format_email", "Give a contact.", {
        "type": "object", "properties": {"name": NAME, "email": {"type": "string",
                                                                 "format": "email",
                                                                 "maxLength": 40}},
        "required": ["name", "email"], "additionalProperties": False}),
    ("anyof_value", "Give an identifier.", {
        "type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0},
                                                          {"type": "string", "maxLength": 12}]}},
        "required": ["id"], "additionalProperties": False}),
    ("oneof_shape", "Describe a shape.", {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "number", "minimum": 0}},
             "required": ["kind", "radius"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"},
                                              "side": {"type": "number", "minimum": 0}},
             "required": ["kind", "side"], "additionalProperties": False}]}),
    ("defs_ref", "Describe two points.", {
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -100, "maximum": 100},
            "y": {"type": "integer", "minimum": -100, "maximum": 100}},
            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                         "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False}),
    ("optional_fields", "Describe a book.", {
        "type": "object", "properties": {"title": SHORT, "year": {"type": "integer",
                                                                  "minimum": 1400,
                                                                  "maximum": 2030},
                                         "subtitle": SHORT},
        "required": ["title"], "additionalProperties": False}),
    ("nullable", "Who is the manager? Nobody may be.", {
        "type": "object", "properties": {"manager": {"type": ["string", "null"],
                                                     "maxLength": 24}},
        "required": ["manager"], "additionalProperties": False}),
    ("const_version", "Report the API version.", {
        "type": "object", "properties": {"version": {"const": "v2"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"], "additionalProperties": False}),
    ("array_of_objects", "List two employees.", {
        "type": "object", "properties": {"employees": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"type": "object", "properties": {"name": NAME,
                                                       "role": {"enum": ["dev", "ops", "pm"]}},
                      "required": ["name", "role"], "additionalProperties": False}}},
        "required": ["employees"], "additionalProperties": False}),
    ("deep_nesting", "Describe a configuration.", {
        "type": "object", "properties": {"server": {"type": "object", "properties": {
            "tls": {"type": "object", "properties": {
                "enabled": {"type": "boolean"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                "required": ["enabled", "port"], "additionalProperties": False}},
            "required": ["tls"], "additionalProperties": False}},
        "required": ["server"], "additionalProperties": False}),
    ("enum_numbers", "Pick a priority level.", {
        "type": "object", "properties": {"level": {"enum": [1, 2, 3]}},
        "required": ["level"], "additionalProperties": False}),
    ("string_length", "Give a three-letter airport code.", {
        "type": "object", "properties": {"iata": {"type": "string", "minLength": 3,
                                                  "maxLength": 3, "pattern": "^[A-Z]+$"}},
        "required": ["iata"], "additionalProperties": False}),
    ("multiple_types", "Give a setting value.", {
        "type": "object", "properties": {"value": {"type": ["integer", "boolean"]}},
        "required": ["value"], "additionalProperties": False}),
    ("tuple_prefix", "Give a coordinate pair.", {
        "type": "array", "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90},
                                         {"type": "number", "minimum": -180, "maximum": 180}],
        "items": False, "minItems": 2, "maxItems": 2}),
    ("recursive_tree", "Describe a small family tree.", {
        "$defs": {"node": {"type": "object", "properties": {
            "name": NAME,
            "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
            "required": ["name"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}),
    ("allof_merge", "Describe a user account.", {
        "allOf": [{"type": "object", "properties": {"user": NAME}, "required": ["user"]},
                  {"type": "object", "properties": {"active": {"type": "boolean"}},
                   "required": ["active"]}]}),
    ("uuid_format", "Give a record id.", {
        "type": "object", "properties": {"uuid": {"type": "string", "format": "uuid"}},
        "required": ["uuid"], "additionalProperties": False}),
    ("time_format", "At what time does the shop open?", {
        "type": "object", "properties": {"opens": {"type": "string", "format": "time"}},
        "required": ["opens"], "additionalProperties": False}),
    ("weather_tool_args", "What's the weather in Paris?", {
        "type": "object", "properties": {
            "location": NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["location", "unit"], "additionalProperties": False}),
    ("sql_query", "Write a query plan.", {
        "type": "object", "properties": {
            "table": {"type": "string", "pattern": "^[a-z_]{1,20}$"},
            "columns": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
                        "minItems": 1, "maxItems": 4},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100}},
        "required": ["table", "columns"], "additionalProperties": False}),
    ("sentiment", "Classify: 'I love this product'.", {
        "type": "object", "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "score"], "additionalProperties": False}),
    ("map_of_counts", "Count the letters in 'abba'.", {
        "type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                   "maximum": 99},
        "maxProperties": 4}),
    ("invoice", "Make an invoice for two items.", {
        "$defs": {"line": {"type": "object", "properties": {
            "item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 50},
            "price": {"type": "number", "minimum": 0, "maximum": 10000}},
            "required": ["item", "qty", "price"], "additionalProperties": False}},
        "type": "object", "properties": {
            "currency": {"enum": ["USD", "EUR", "JPY"]},
            "lines": {"type": "array", "items": {"$ref": "#/$defs/line"},
                      "minItems": 1, "maxItems": 2}},
        "required": ["currency", "lines"], "additionalProperties": False}),
]

"""JSON schemas for the structured-output tests: each bounds its output's length (maxLength on
strings, maxItems on arrays, integer ranges), so a greedy small model finishes within max_tokens."""

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("Give a colour.", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                        "required": ["colour"]}),
    ("List some fruits.", {
        "type": "object", "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}},
        "required": ["fruits"]}),
    ("A point in 2D.", {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                       "y": {"type": "integer", "minimum": -100, "maximum": 100}},
        "required": ["x", "y"]}),
    ("A book with its author.", {
        "type": "object",
        "properties": {"title": NAME,
                       "author": {"type": "object", "properties": {"first": NAME, "last": NAME},
                                  "required": ["first", "last"], "additionalProperties": False}},
        "required": ["title", "author"]}),
    ("Is it raining?", {"type": "object", "properties": {"raining": {"type": "boolean"}}, "required": ["raining"]}),
    ("A product code.", {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"]}),
    ("Scores of three games.", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "minItems": 3, "maxItems": 3}),
    ("An id, either a number or a short name.", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, NAME]}},
        "required": ["id"]}),
    ("A city, optionally its country.", {
        "type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city"],
        "additionalProperties": False}),
    ("A traffic light state.", {"type": "string", "enum": ["red", "amber", "green"]}),
    ("Pick a number from 1 to 5.", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("A team of people.", {
        "type": "object",
        "properties": {"team": NAME, "members": {
            "type": "array", "maxItems": 3, "items": {
                "type": "object", "properties": {"name": NAME, "role": {"enum": ["lead", "dev", "qa"]}},
                "required": ["name", "role"], "additionalProperties": False}}},
        "required": ["team", "members"]}),
    ("A shape.", {
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "r": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"},
                                              "side": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["kind", "side"], "additionalProperties": False}]}),
    ("A date.", {
        "type": "object",
        "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "month": {"type": "integer", "minimum": 1, "maximum": 12},
                       "day": {"type": "integer", "minimum": 1, "maximum": 31}},
        "required": ["year", "month", "day"]}),
    ("Tags for a blog post.", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["ai", "cpu", "rust", "python"]},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"]}),
    ("A weather report.", {
        "type": "object",
        "properties": {"city": NAME, "temp_c": {"type": "integer", "minimum": -50, "maximum": 60},
                       "sky": {"enum": ["sunny", "cloudy", "rain"]}, "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["city", "temp_c", "sky"], "additionalProperties": False}),
    ("A matrix of 2 x 2 digits.", {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("A user with an email.", {
        "type": "object",
        "properties": {"user": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["user", "email"]}),
    ("Settings.", {
        "type": "object",
        "properties": {"verbose": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                       "mode": {"type": "string", "enum": ["fast", "safe"]}},
        "required": ["verbose", "level", "mode"], "additionalProperties": False}),
]

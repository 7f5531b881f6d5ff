"""The JSON schemas `triode bench structured` measures, each with a valid instance that the
grammar engines walk token by token: flat (`small`), nested with arrays, enums, ranges and
patterns (`nested`), 30 properties with $defs (`large`), and the constraint of the served part
(`served`), whose outputs cannot end early."""

from __future__ import annotations

from typing import Any

_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
_STRINGS = {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """A closed object whose properties are all required (so instances list them in order)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


SMALL = _object(
    {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
     "active": {"type": "boolean"}}
)  # fmt: skip
SMALL_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True}

_ITEM = _object(
    {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
     "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
     "price_cents": {"type": "integer", "minimum": 0},
     "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}}
)  # fmt: skip
NESTED = _object(
    {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
     "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
     "customer": _object(
         {"name": {"type": "string", "minLength": 1, "maxLength": 64},
          "tier": {"enum": ["free", "pro", "enterprise"]},
          "age": {"type": "integer", "minimum": 18, "maximum": 120}}),
     "items": {"type": "array", "items": _ITEM, "minItems": 1, "maxItems": 20},
     "shipping": _object(
         {"country": {"type": "string", "pattern": "^[A-Z]{2}$"},
          "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
          "express": {"type": "boolean"}})}
)  # fmt: skip
NESTED_INSTANCE = {
    "order_id": "ORD-004217", "status": "shipped",
    "customer": {"name": "Grace Hopper", "tier": "enterprise", "age": 45},
    "items": [
        {"sku": "KEY-0042", "quantity": 2, "price_cents": 1999, "tags": ["usb", "black"]},
        {"sku": "MSE-1100", "quantity": 1, "price_cents": 2450, "tags": []},
        {"sku": "CBL-0007", "quantity": 12, "price_cents": 399, "tags": ["usb-c", "1m", "gift"]},
    ],
    "shipping": {"country": "DE", "postcode": "10115", "express": False},
}  # fmt: skip

_REF = {name: {"$ref": f"#/$defs/{name}"} for name in ("date", "money", "address", "contact",
                                                       "person")}  # fmt: skip
LARGE = _object(
    {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 80},
     "created": _REF["date"], "updated": _REF["date"], "owner": _REF["person"],
     "billing_address": _REF["address"], "shipping_address": _REF["address"],
     "balance": _REF["money"], "credit_limit": _REF["money"],
     "status": {"enum": ["active", "suspended", "closed"]},
     "tier": {"enum": ["free", "pro", "enterprise"]}, "score": {"type": "number"},
     "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "verified": {"type": "boolean"},
     "newsletter": {"type": "boolean"}, "tags": _STRINGS,
     "notes": {"type": "string", "maxLength": 200},
     "locale": {"type": "string", "pattern": "^[a-z]{2}-[A-Z]{2}$"},
     "timezone": {"type": "string"}, "referrer": _REF["person"],
     "emergency_contact": _REF["contact"], "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150},
     "height_cm": {"type": "number"}, "weight_kg": {"type": "number"},
     "languages": {"type": "array", "items": {"enum": ["en", "de", "fr", "es", "ja"]}},
     "last_login": _REF["date"], "login_count": {"type": "integer", "minimum": 0},
     "preferences": _object({"theme": {"enum": ["light", "dark"]},
                             "font_size": {"type": "integer", "minimum": 8, "maximum": 32}}),
     "invoices": {"type": "array", "maxItems": 10, "items": _object(
         {"number": {"type": "string", "pattern": "^INV-[0-9]{5}$"}, "total": _REF["money"],
          "date": _REF["date"]})},
     "website": {"type": "string"}}
) | {"$defs": {
    "date": _DATE,
    "money": _object({"amount_cents": {"type": "integer", "minimum": 0},
                      "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]}}),
    "address": _object({"street": {"type": "string"}, "city": {"type": "string"},
                        "postcode": {"type": "string", "pattern": "^[0-9A-Z ]{3,10}$"},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
    "contact": _object({"email": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
                        "phone": {"type": "string", "pattern": "^\\+[0-9]{6,15}$"}}),
    "person": _object({"name": {"type": "string"}, "contact": _REF["contact"],
                       "address": _REF["address"]}),
}}  # fmt: skip
_ADDRESS = {"street": "Unter den Linden 6", "city": "Berlin", "postcode": "10117", "country": "DE"}
_CONTACT = {"email": "ada@example.com", "phone": "+4930123456"}
_PERSON = {"name": "Ada Lovelace", "contact": _CONTACT, "address": _ADDRESS}
LARGE_INSTANCE = {
    "id": 1815, "name": "Analytical Engines Ltd", "created": "2024-01-15",
    "updated": "2025-06-30", "owner": _PERSON, "billing_address": _ADDRESS,
    "shipping_address": {"street": "1 Main St", "city": "Boston", "postcode": "02108",
                         "country": "US"},
    "balance": {"amount_cents": 125000, "currency": "EUR"},
    "credit_limit": {"amount_cents": 500000, "currency": "EUR"}, "status": "active",
    "tier": "pro", "score": 87.25, "rating": 4, "verified": True, "newsletter": False,
    "tags": ["priority", "b2b", "emea"], "notes": "Prefers invoices by email.",
    "locale": "en-GB", "timezone": "Europe/London",
    "referrer": {"name": "Charles Babbage", "contact": {"email": "cb@example.org",
                 "phone": "+441234567890"}, "address": _ADDRESS},
    "emergency_contact": _CONTACT, "age": 36, "height_cm": 165.5, "weight_kg": 58.0,
    "languages": ["en", "fr"], "last_login": "2025-07-01", "login_count": 342,
    "preferences": {"theme": "dark", "font_size": 14},
    "invoices": [
        {"number": "INV-00017", "total": {"amount_cents": 9900, "currency": "EUR"},
         "date": "2025-05-01"},
        {"number": "INV-00018", "total": {"amount_cents": 12900, "currency": "EUR"},
         "date": "2025-06-01"},
    ],
    "website": "https://example.com",
}  # fmt: skip

# Part 2's constraint: valid outputs hold at least 200 strings, so none ends within 128 tokens.
SERVE_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200}
SERVE_INSTANCE = ["sea", "trains", "autumn", "chess"] * 50

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "small": (SMALL, SMALL_INSTANCE),
    "nested": (NESTED, NESTED_INSTANCE),
    "large": (LARGE, LARGE_INSTANCE),
    "served": (SERVE_SCHEMA, SERVE_INSTANCE),
}

"""Parsing tagged token strings and putting their fields in reading order."""

from moss_npu.text.tokens import parse_tokens, reorder, serialize


def test_parse_keeps_escapes_and_order():
    tokens = parse_tokens('char { value: "\\"" } date { day: "一" month: "五" }')
    assert [t.name for t in tokens] == ["char", "date"]
    assert tokens[0].fields() == [("value", '\\"')]
    assert tokens[1].fields() == [("day", "一"), ("month", "五")]


def test_reorder_puts_reading_order_and_drops_unknown_fields():
    tokens = reorder(parse_tokens('fraction { numerator: "一" denominator: "三" extra: "x" }'), "zh")
    assert serialize(tokens) == 'fraction { denominator: "三" numerator: "一" }'


def test_preserve_order_keeps_the_tagged_order():
    text = 'date { preserve_order: "true" year: "y" day: "d" }'
    assert serialize(reorder(parse_tokens(text), "en")) == text


def test_a_key_given_twice_is_read_twice_with_its_last_value():
    assert serialize(parse_tokens('w { v: "a" v: "b" }')) == 'w { v: "b" v: "b" }'

"""The robust cleanup's rules (docs/text-normalization.md#what-happens), each on a text that shows it alone."""

import pytest

from moss_npu.text.robust import clean_for_speech, end_with_punctuation


@pytest.mark.parametrize("text,expected", [
    ("今天发布", "今天发布。"),  # a final mark is added
    ("今天发布。", "今天发布。"),
    ('他说"你好"', '他说"你好"。'),  # closing quotes are looked through
    ("Is it?", "Is it?"),
    ("", ""),
])
def test_every_text_ends_with_a_punctuation_mark(text, expected):
    assert clean_for_speech(text) == expected


def test_end_with_punctuation_skips_closers_and_spaces():
    assert end_with_punctuation("好」 ") == "好」 。"
    assert end_with_punctuation("好！」") == "好！」"


def test_lines_and_list_marks_become_sentences():
    assert clean_for_speech("# 标题\n- 第一项\n2. 第二项\n\n> 引用") == "标题。第一项。第二项。引用。"


def test_spaces_follow_the_script():
    assert clean_for_speech("这 是  一段 文本") == "这是一段文本。"  # none inside Chinese
    assert clean_for_speech("This   is  English") == "This is English。"  # one inside Latin text
    assert clean_for_speech("这是Anthropic的npm包") == "这是 Anthropic 的 npm 包。"  # one at a script change
    assert clean_for_speech("共 3 个") == "共3个。"  # none between Chinese and digits


def test_shielded_tokens_survive_untouched():
    tokens = ("https://a.example/x_y?q=1", "ops+tts@example.ai", "@foo_bar", "#tag_x", "app.js.map", ".env")
    for token in tokens:
        assert token in clean_for_speech(f"看看 {token} 吧")
    assert clean_for_speech("foo_bar") == "foo bar。"  # a plain underscore becomes a space


def test_brackets_become_double_quotes_and_dashes_sentence_ends():
    assert clean_for_speech("[S1]你好。") == '"S1"你好。'
    assert clean_for_speech("【公告】今天——明天") == '"公告"今天。明天。'
    assert clean_for_speech("A -> B") == "A，B。"


def test_repeated_punctuation_collapses():
    assert clean_for_speech("真的？？？！！！") == "真的？！"
    assert clean_for_speech("好！！！") == "好！"
    assert clean_for_speech("等等……再说") == "等等。再说。"


def test_invisible_characters_are_dropped():
    assert clean_for_speech("a\u200bb\x07c\u3000d") == "abc d。"

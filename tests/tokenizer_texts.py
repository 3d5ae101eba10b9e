"""The mixed corpus Hugging Face tokenizers are compared with transformers' on: English prose, code, CJK, emoji,
combining characters, whitespace runs, control characters, very long words, numbers."""

MIXED = [
    "",
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times; it was the "
    "age of wisdom, it was the age of foolishness.",
    'def square(x: int) -> int:\n    """The square."""\n    return x ** 2  # squared\n\nprint({"a": [1, 2.5e-3]})\n',
    "中文文本的例子，日本語のテキスト、한국어 텍스트입니다. 漢字かな交じり文",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 flags 🇫🇷🇯🇵",
    "combining: e\u0301 a\u0308 o\u0302\u0323 \u1100\u1161\u11a8 A\u030a vs \u00c5, ﬁ ligature, ｆｕｌｌｗｉｄｔｈ",
    "   leading\t\ttabs  and   runs   \n\n\n\n   of whitespace \u00a0\u2003\u3000 trailing   ",
    "control \x00\x01\x07\x1b[31mred\x1b[0m \x7f\x85 \r\n windows\r\nline\rends",
    "a" * 3000,
    "supercalifragilisticexpialidocious" * 60,
    "https://example.com/" + "path/" * 200 + "?q=" + "x1y2z3" * 150,
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
]

def word_count(text):
    """The number of words in text; words are separated by whitespace."""
    if not text:
        return 0
    return len(text.split(" "))


def char_count(text, *, spaces=True):
    """The number of characters, without whitespace unless spaces is true."""
    if spaces:
        return len(text)
    return sum(1 for c in text if not c.isspace())

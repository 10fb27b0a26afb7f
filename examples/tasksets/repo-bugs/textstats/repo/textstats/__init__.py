from textstats.core import char_count, word_count

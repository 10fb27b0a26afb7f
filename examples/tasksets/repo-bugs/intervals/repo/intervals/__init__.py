from intervals.merge import merge, total_length

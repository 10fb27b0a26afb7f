from lrucache.lru import LRU

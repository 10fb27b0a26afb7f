class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, item, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.stock[item] = self.stock.get(item, 0) + count

    def remove(self, item, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.stock[item] = self.stock.get(item, 0) - count

    def count(self, item):
        return self.stock.get(item, 0)

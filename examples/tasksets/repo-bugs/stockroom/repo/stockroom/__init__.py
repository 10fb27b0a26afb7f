from stockroom.inventory import Inventory

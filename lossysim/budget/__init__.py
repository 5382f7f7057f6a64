"""Loss budgets: per traffic family and recovery policy, the largest loss rate training tolerates."""
from .families import FAMILIES, Family
from .search import Budget, Point, find_budget

__all__ = ["FAMILIES", "Family", "Budget", "Point", "find_budget"]

"""memprof: where training memory goes, and what to change so it fits."""

from .categories import Category
from .report import Breakdown, Report
from .tracker import Tracker, track

__all__ = ["Breakdown", "Category", "Report", "Tracker", "track"]
__version__ = "0.1.0"

import os
import sys

# Tests import the top-level scripts (model.py, attention.py, ...) the way lessons do.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

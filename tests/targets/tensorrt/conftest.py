import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # trt_graphs
sys.path.insert(0, str(Path(__file__).parents[2] / "export"))  # export_helpers

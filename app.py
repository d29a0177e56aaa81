"""Hugging Face Space entry point: the trainmem web calculator (``trainmem serve`` locally).

A Gradio Space runs ``python app.py``; its ``requirements.txt`` needs ``trainmem[web]`` (or
this repository: ``.[web]``). Locally the same page starts with ``trainmem serve``.
"""

import sys
from pathlib import Path

try:
    import trainmem  # noqa: F401
except ImportError:  # a checkout of this repository that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

from trainmem.web import build_app, launch

demo = build_app()  # what `gradio app.py` (reload mode) looks for

if __name__ == "__main__":
    # host and port from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT, as Spaces set them
    launch(host=None, port=None, app=demo)

"""`import stratagem.env` imports torch and nothing heavier, with no side effects."""

import json
import subprocess
import sys

PROBE = r"""
import json, logging, os, sys
env_before = dict(os.environ)
root = logging.getLogger()
root_state = (list(root.handlers), root.level)
import stratagem.env
from stratagem.env import get_rank
print(json.dumps({
    'heavy': [m for m in ('deepspeed', 'fairscale', 'matplotlib', 'cv2', 'mmengine',
                          'stratagem.env.collect') if m in sys.modules],
    'env_changed': sorted(set(os.environ.items()) ^ set(env_before.items())),
    'root_changed': (list(root.handlers), root.level) != root_state,
    'stratagem_handlers': len(logging.getLogger('stratagem').handlers),
}))
"""


def test_import_env_is_cheap_and_has_no_side_effects():
    out = subprocess.run(
        [sys.executable, '-c', PROBE], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {
        'heavy': [],
        'env_changed': [],
        'root_changed': False,
        'stratagem_handlers': 0,
    }

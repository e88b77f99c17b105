"""tox's inline plugin for this project (tox loads toxfile.py beside tox.ini by itself).

It adds one setting, ``launcher_site_packages``: the environment also sees the site-packages of
the Python that runs tox. The gpu environment needs it because a CUDA build of torch often lives
in a virtual environment (such as /opt/torch/.venv), and tox builds every
environment from the *base* interpreter: ``system_site_packages`` then shows the base's packages,
not that environment's torch. So ``python3 -m tox -e gpu`` sees what ``python3 -m pytest`` sees,
and nothing has to be downloaded.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

from tox.plugin import impl

PTH_NAME = "_launcher_site_packages.pth"


@impl
def tox_add_env_config(env_conf, state):  # noqa: ARG001 - tox's hook signature
    env_conf.add_config(
        keys=["launcher_site_packages"], of_type=bool, default=False,
        desc="also see the site-packages of the Python that runs tox (appended, after the environment's own)",
    )


@impl
def tox_before_run_commands(tox_env):
    if "launcher_site_packages" not in tox_env.conf:
        return
    pth = Path(tox_env.conf["env_site_packages_dir"]) / PTH_NAME
    same_python = tuple(tox_env.base_python.version_info[:2]) == sys.version_info[:2]
    if not (tox_env.conf["launcher_site_packages"] and same_python):
        pth.unlink(missing_ok=True)
        return
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    pth.write_text("".join(f"{d}\n" for d in dirs if Path(d).is_dir()))

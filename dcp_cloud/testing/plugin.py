"""pytest plugin (entry point ``dcp_cloud``): reusable object-store fixtures.

Installed with dcp_cloud, so a user's own test suite gets ``moto_server``, ``s3_bucket``,
``gcs_emulator``, ``gcs_bucket``, ``azurite_server``, ``azure_container``, ``rgw_target`` ... with no
conftest code.
"""

from .azure_fixtures import *  # noqa: F401,F403
from .gcs_fixtures import *  # noqa: F401,F403
from .s3_fixtures import *  # noqa: F401,F403
from .s3_servers import *  # noqa: F401,F403

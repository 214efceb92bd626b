"""``import dcp_cloud.auto`` routes ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with a cloud
``checkpoint_id`` through dcp_cloud (:func:`dcp_cloud.install` with the environment's configuration), for
frameworks that take a module to import rather than code to run."""

from __future__ import annotations

from .integrations.routing import install

install()

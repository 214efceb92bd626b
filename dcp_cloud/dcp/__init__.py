"""PyTorch DCP's storage layer on object stores: the public constructors (``api``) and the ones chosen by
URI (``factory``), what writers and readers share (``base``, ``metashare``) and the typed ``save`` / ``load``;
the save side in ``save/``, the load side in ``load/``, device staging in ``device/``. The on-store format
they write and read is :mod:`dcp_cloud.format`."""

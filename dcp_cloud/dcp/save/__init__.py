"""The save side of the DCP adapter: ``CloudWriter``, a rank's objects and how its items reach them,
incremental saves, and ``async_save``'s stager."""

"""Copy-on-write snapshots: the helper process and the userfaultfd it drives."""

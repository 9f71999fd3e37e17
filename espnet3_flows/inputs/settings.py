"""What configs name of the inputs layer, importable without its libraries (numpy, soundfile,
fsspec): a config is read before anything of a run starts (:mod:`espnet3_flows.job_config`)."""

#: Utterances of the generated demo corpus (both jobs' demos use the same files).
DEMO_UTTERANCES = 300

#: ``fingerprint`` option values: ``stat`` reads each file's size and mtime (or ETag); ``strict``
#: its ctime and inode number too; ``manifest`` trusts the manifest: a shard's hash covers its lines
#: (ids, paths), not the files.
FINGERPRINT_MODES = ("stat", "strict", "manifest")

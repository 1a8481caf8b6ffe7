"""Running on many processes and hosts: start-up from a launcher's environment
(``distributed``) and the launcher itself (``launch``)."""

"""Build tools, run by hand or by the Makefile, never by the ``tokenbus`` command or a service:
``make lock`` (:mod:`.lockfile`) writes the images' locked versions."""

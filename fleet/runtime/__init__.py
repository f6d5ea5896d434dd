"""The job's runtime: who this process is (roles, environment), where the job meets (rendezvous,
signing, secrets), what it leaves on disk, and the context every wrapped object shares."""

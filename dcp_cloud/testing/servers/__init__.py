"""The test servers, each in a child process that dies with its owner: moto (S3), s3rver (S3, npm), Ceph RGW
(S3), fake-gcs-server (GCS) and Azurite (Azure); the local store needs none."""

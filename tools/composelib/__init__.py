"""docker/compose.yaml's topology without a Docker engine: its services read from the file
(spec), its images built and its containers run with buildah, each service in a network
namespace of its own on one bridge (net, containers); tools/compose_check.py drives them."""

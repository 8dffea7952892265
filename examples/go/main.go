// Command digits-client classifies digit images (PNG or JPEG files) through the router's `digits`
// ensemble, using nothing but the gRPC stubs generated from protos/ by protoc. Before inferring it reads
// the ensemble's metadata (its tensors) and its configuration (platform, batching, steps).
//
//	digits-client -url 127.0.0.1:8001 three.png seven.png
//
// Where the router asks for a token, give it with -token or PIPELINE_TOKEN.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"log"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	pb "pipelineclient/inference"
)

func main() {
	url := flag.String("url", "127.0.0.1:8001", "the router's gRPC address")
	model := flag.String("model", "digits", "the ensemble to call")
	timeout := flag.Duration("timeout", 30*time.Second, "deadline of each call")
	token := flag.String("token", os.Getenv("PIPELINE_TOKEN"), "bearer token, where the router asks for one (env PIPELINE_TOKEN)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s [-url HOST:PORT] [-model NAME] [-token TOKEN] IMAGE...\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}

	conn, err := grpc.Dial(*url, grpc.WithInsecure())
	if err != nil {
		log.Fatalf("cannot connect to %s: %v", *url, err)
	}
	defer conn.Close()
	client := pb.NewGRPCInferenceServiceClient(conn)
	call := func() (context.Context, context.CancelFunc) {
		ctx := context.Background()
		if *token != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*token)
		}
		return context.WithTimeout(ctx, *timeout)
	}

	ctx, cancel := call()
	ready, err := client.ModelReady(ctx, &pb.ModelReadyRequest{Name: *model})
	cancel()
	if err != nil {
		log.Fatalf("ModelReady %s: %v", *model, err)
	}
	if !ready.Ready {
		log.Fatalf("model %s is not ready", *model)
	}
	printMetadata(client, call, *model)
	printConfig(client, call, *model)

	images := make([][]byte, flag.NArg())
	for i, path := range flag.Args() {
		if images[i], err = os.ReadFile(path); err != nil {
			log.Fatal(err)
		}
	}
	labels, scores, err := classify(client, call, *model, images)
	if err != nil {
		log.Fatalf("ModelInfer %s: %v", *model, err)
	}
	for i, path := range flag.Args() {
		fmt.Printf("%s: digit %d (probability %.3f)\n", path, labels[i], scores[i][labels[i]])
	}
}

type callContext func() (context.Context, context.CancelFunc)

// printMetadata prints the model's versions, platform and tensors.
func printMetadata(client pb.GRPCInferenceServiceClient, call callContext, model string) {
	ctx, cancel := call()
	defer cancel()
	meta, err := client.ModelMetadata(ctx, &pb.ModelMetadataRequest{Name: model})
	if err != nil {
		log.Fatalf("ModelMetadata %s: %v", model, err)
	}
	fmt.Printf("metadata: %s versions %v platform %s\n", meta.Name, meta.Versions, meta.Platform)
	for _, t := range meta.Inputs {
		fmt.Printf("  input  %s %s %v\n", t.Name, t.Datatype, t.Shape)
	}
	for _, t := range meta.Outputs {
		fmt.Printf("  output %s %s %v\n", t.Name, t.Datatype, t.Shape)
	}
}

// printConfig prints the model's configuration: platform, batching and, for an ensemble, its steps.
func printConfig(client pb.GRPCInferenceServiceClient, call callContext, model string) {
	ctx, cancel := call()
	defer cancel()
	reply, err := client.ModelConfig(ctx, &pb.ModelConfigRequest{Name: model})
	if err != nil {
		log.Fatalf("ModelConfig %s: %v", model, err)
	}
	config := reply.Config
	fmt.Printf("config: %s platform %s max_batch_size %d\n", config.Name, config.Platform, config.MaxBatchSize)
	for _, step := range config.GetEnsembleScheduling().GetStep() {
		fmt.Printf("  step %s: inputs %s -> outputs %s\n", step.ModelName, mapping(step.InputMap), mapping(step.OutputMap))
	}
}

// mapping writes a tensor map sorted by key, e.g. "IMAGE=IMAGE".
func mapping(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	pairs := make([]string, len(keys))
	for i, k := range keys {
		pairs[i] = k + "=" + m[k]
	}
	return strings.Join(pairs, ",")
}

// classify sends every image in one request: IMAGE is BYTES [N, 1], sent raw, where each element is a
// 4-byte little-endian length and its bytes. Outputs come back raw and little-endian: LABEL INT64 [N, 1],
// SCORES FP32 [N, 10].
func classify(client pb.GRPCInferenceServiceClient, call callContext, model string, images [][]byte) ([]int64, [][]float32, error) {
	var raw []byte
	for _, image := range images {
		raw = binary.LittleEndian.AppendUint32(raw, uint32(len(image)))
		raw = append(raw, image...)
	}
	request := &pb.ModelInferRequest{
		ModelName: model,
		Inputs: []*pb.ModelInferRequest_InferInputTensor{
			{Name: "IMAGE", Datatype: "BYTES", Shape: []int64{int64(len(images)), 1}},
		},
		RawInputContents: [][]byte{raw},
	}
	ctx, cancel := call()
	defer cancel()
	response, err := client.ModelInfer(ctx, request)
	if err != nil {
		return nil, nil, err
	}
	outputs := map[string][]byte{}
	for i, out := range response.Outputs {
		outputs[out.Name] = response.RawOutputContents[i]
	}
	n := len(images)
	if len(outputs["LABEL"]) != 8*n || len(outputs["SCORES"]) != 4*10*n {
		return nil, nil, fmt.Errorf("unexpected outputs: LABEL %d bytes, SCORES %d bytes for %d images",
			len(outputs["LABEL"]), len(outputs["SCORES"]), n)
	}
	labels := make([]int64, n)
	scores := make([][]float32, n)
	for i := 0; i < n; i++ {
		labels[i] = int64(binary.LittleEndian.Uint64(outputs["LABEL"][8*i:]))
		scores[i] = make([]float32, 10)
		for j := range scores[i] {
			scores[i][j] = math.Float32frombits(binary.LittleEndian.Uint32(outputs["SCORES"][4*(10*i+j):]))
		}
	}
	return labels, scores, nil
}

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import com.networknt.schema.JsonSchema;
import com.networknt.schema.JsonSchemaFactory;
import com.networknt.schema.SpecVersion;
import com.networknt.schema.ValidationMessage;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.Base64;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.UUID;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * A vramgate producer in Java: sends request events built against the published contract
 * (schemas/v1), then reads the results and dead letters that come back and holds each to its
 * schema too. The Java twin of examples/python/producer.py.
 *
 * <pre>
 * java -cp 'target/lib/*' src/main/java/Producer.java BROKERS SCHEMAS-DIR \
 *     VOICE-REQUESTS VOICE-RESULTS VOICE-DLQ IMAGE-REQUESTS IMAGE-RESULTS IMAGE-DLQ SPEECH.wav PHOTO
 * </pre>
 *
 * Files go inline (base64). One more request names a file that is not there, to show a dead
 * letter. Exits with status 1 when an event breaks its schema, an answer does not come within
 * two minutes, or an answer is not what its request should get.
 */
public final class Producer {
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final Duration TIMEOUT = Duration.ofSeconds(120);

    private Producer() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 10) {
            fail("usage: Producer BROKERS SCHEMAS VOICE-REQ VOICE-RES VOICE-DLQ IMAGE-REQ IMAGE-RES IMAGE-DLQ WAV PHOTO");
        }
        String brokers = args[0];
        Map<String, JsonSchema> schemas = loadSchemas(Path.of(args[1]));
        String[] voice = {args[2], args[3], args[4]};
        String[] image = {args[5], args[6], args[7]};

        // name -> (topic, event)
        Map<String, ObjectNode> sent = new LinkedHashMap<>();
        sent.put("voice", request(schemas, "voice", Files.readAllBytes(Path.of(args[8])), null));
        sent.put("image", request(schemas, "image", Files.readAllBytes(Path.of(args[9])), null));
        sent.put("missing", request(schemas, "voice", null, "file:///no/such/file.wav"));
        Map<String, String> topics = Map.of("voice", voice[0], "image", image[0], "missing", voice[0]);

        Properties consumerProps = new Properties();
        consumerProps.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, brokers);
        consumerProps.put(ConsumerConfig.GROUP_ID_CONFIG, "java-producer-" + UUID.randomUUID());
        consumerProps.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        consumerProps.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        consumerProps.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        Properties producerProps = new Properties();
        producerProps.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, brokers);
        producerProps.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        producerProps.put(ProducerConfig.ACKS_CONFIG, "all");

        Map<String, String> wanted = new HashMap<>();
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(producerProps, new StringSerializer(), new StringSerializer())) {
            for (Map.Entry<String, ObjectNode> e : sent.entrySet()) {
                String id = e.getValue().get("id").asText();
                wanted.put(id, e.getKey());
                producer.send(new ProducerRecord<>(topics.get(e.getKey()), id, JSON.writeValueAsString(e.getValue()))).get();
            }
        }
        System.out.println("sent " + sent.size() + " requests: " + String.join(", ", wanted.keySet()));

        Map<String, ConsumerRecord<String, String>> answers = new HashMap<>();
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(consumerProps, new StringDeserializer(), new StringDeserializer())) {
            consumer.subscribe(List.of(voice[1], voice[2], image[1], image[2]));
            Instant deadline = Instant.now().plus(TIMEOUT);
            while (answers.size() < wanted.size() && Instant.now().isBefore(deadline)) {
                for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(500))) {
                    JsonNode value = JSON.readTree(record.value());
                    String id = value.path("id").asText();
                    if (wanted.containsKey(id)) {
                        answers.put(id, record);
                    }
                }
            }
        }
        for (String id : wanted.keySet()) {
            if (!answers.containsKey(id)) {
                fail("no answer within " + TIMEOUT.toSeconds() + " s for " + wanted.get(id));
            }
        }

        for (Map.Entry<String, ConsumerRecord<String, String>> e : answers.entrySet()) {
            String name = wanted.get(e.getKey());
            ConsumerRecord<String, String> record = e.getValue();
            JsonNode value = JSON.readTree(record.value());
            if (record.topic().endsWith(".dlq")) {
                valid(schemas, "dead-letter", value);
                String kind = value.path("error").path("kind").asText();
                if (!name.equals("missing") || !kind.equals("input_not_found")) {
                    fail(name + " was dead-lettered: " + value.path("error"));
                }
                System.out.println(name + ": dead letter " + kind + ": " + value.path("error").path("message").asText());
            } else {
                valid(schemas, "result", value);
                valid(schemas, name + "-output", value.get("output"));
                if (name.equals("voice")) {
                    JsonNode segments = value.path("output").path("segments");
                    if (segments.isEmpty()) {
                        fail("no speech found in the spoken WAV");
                    }
                    System.out.println("voice: " + segments.size() + " speech segment(s), first " + segments.get(0));
                } else {
                    JsonNode output = value.path("output");
                    System.out.println("image: " + output.path("faces").size() + " face(s) in a "
                            + output.path("width").asInt() + "x" + output.path("height").asInt() + " image");
                }
            }
        }
        System.out.println("every event and answer matches schemas/v1");
    }

    private static Map<String, JsonSchema> loadSchemas(Path folder) throws Exception {
        JsonSchemaFactory factory = JsonSchemaFactory.getInstance(SpecVersion.VersionFlag.V202012);
        Map<String, JsonSchema> schemas = new HashMap<>();
        for (String name : List.of("request", "result", "dead-letter", "voice-output", "image-output")) {
            String text = Files.readString(folder.resolve(name + ".json"), StandardCharsets.UTF_8);
            schemas.put(name, factory.getSchema(JSON.readTree(text)));
        }
        return schemas;
    }

    private static ObjectNode request(Map<String, JsonSchema> schemas, String task, byte[] data, String uri) {
        ObjectNode event = JSON.createObjectNode();
        event.put("version", 1);
        event.put("id", "java-" + task + "-" + UUID.randomUUID());
        event.put("task", task);
        ObjectNode input = event.putObject("input");
        if (data != null) {
            input.put("data_b64", Base64.getEncoder().encodeToString(data));
        } else {
            input.put("uri", uri);
        }
        valid(schemas, "request", event);
        return event;
    }

    private static void valid(Map<String, JsonSchema> schemas, String name, JsonNode value) {
        Set<ValidationMessage> errors = schemas.get(name).validate(value);
        if (!errors.isEmpty()) {
            fail("breaks " + name + ".json: " + errors);
        }
    }

    private static void fail(String message) {
        System.err.println(message);
        System.exit(1);
    }
}
